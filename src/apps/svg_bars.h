// A horizontal bar chart as SVG: for each row, a measured value and its floor, on a log scale,
// so that a person sees at a glance which ops are far from their floor.
#pragma once
#include <string>
#include <vector>

namespace kestrel::apps {

struct BarRow {
  std::string label;
  double measured = 0, floor = 0;  // same unit; floor 0: none
};

std::string svg_bars(const std::string& title, const std::string& unit, const std::vector<BarRow>& rows);

}  // namespace kestrel::apps
