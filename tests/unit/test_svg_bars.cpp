// The per-op plot of `kestrel bench --ops --plot`: rows, floors and read-chain ticks where given.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "apps/svg_bars.h"

namespace kestrel {
namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(SvgBars, DrawsEachRowWithItsFloorAndChain) {
  const std::vector<apps::BarRow> rows = {{"experts", 691.1, 242.4, 365.7}, {"o_proj <&>", 160.9, 53.9, 102.6},
                                          {"between ops", 302.7, 0.0, 0.0}};
  const std::string svg = apps::svg_bars("Qwen3, batch 1", "us per step", rows);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("o_proj &lt;&amp;&gt;"), std::string::npos) << "labels are escaped";
  EXPECT_EQ(count(svg, "fill=\"#3b73b9\""), 3u) << "a measured bar per row";
  EXPECT_EQ(count(svg, "fill=\"#999\""), 2u) << "a floor bar where there is a floor";
  EXPECT_EQ(count(svg, "stroke=\"#e08a1e\""), 2u) << "a chain tick where there is a chain";
  EXPECT_NE(svg.find("691.1 (2.9x floor, 1.9x reads)"), std::string::npos);
  EXPECT_NE(svg.find("302.7<"), std::string::npos) << "no ratio without a floor";
  EXPECT_NE(svg.find("orange tick"), std::string::npos) << "the legend names the ticks";
  EXPECT_EQ(svg.find("nan"), std::string::npos);
}

TEST(SvgBars, NoChainsNoTicksAndEmptyIsValid) {
  const std::string svg = apps::svg_bars("t", "us", {{"a", 10, 5}, {"b", -3, 0}});
  EXPECT_EQ(count(svg, "stroke=\"#e08a1e\""), 0u);
  EXPECT_EQ(svg.find("orange tick"), std::string::npos);
  EXPECT_NE(svg.find("10.0 (2.0x floor)"), std::string::npos);
  const std::string empty = apps::svg_bars("t", "us", {});
  EXPECT_NE(empty.find("</svg>"), std::string::npos);
  EXPECT_EQ(empty.find("nan"), std::string::npos);
  EXPECT_EQ(empty.find("inf"), std::string::npos);
}

}  // namespace
}  // namespace kestrel
