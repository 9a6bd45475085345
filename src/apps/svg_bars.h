// A horizontal bar chart as SVG: for each row, a measured value and its floor, on a log scale,
// so that a person sees at a glance which ops are far from their floor; where given, a tick for
// what kernels that only read the op's bytes cost (bench --ops' chain), which splits that
// distance into what the kernels' sizes cost anyway and what the op's own kernels add.
#pragma once
#include <string>
#include <vector>

namespace kestrel::apps {

struct BarRow {
  std::string label;
  double measured = 0, floor = 0;  // same unit; floor 0: none
  double chain = 0;                 // same unit; 0: none
};

std::string svg_bars(const std::string& title, const std::string& unit, const std::vector<BarRow>& rows);

}  // namespace kestrel::apps
