#include "apps/svg_bars.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace kestrel::apps {
namespace {

std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else o += c;
  }
  return o;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

std::string svg_bars(const std::string& title, const std::string& unit, const std::vector<BarRow>& rows) {
  const int left = 130, width = 560, row_h = 34, top = 50;
  double lo = 1e300, hi = 0;
  for (const BarRow& r : rows)
    for (double v : {r.measured, r.floor, r.chain})
      if (v > 0) lo = std::min(lo, v), hi = std::max(hi, v);
  if (hi <= 0) lo = 0.1, hi = 1;
  const double l0 = std::floor(std::log10(lo)), l1 = std::ceil(std::log10(hi));
  auto x = [&](double v) { return left + (v > 0 ? (std::log10(v) - l0) / std::max(l1 - l0, 1.0) * width : 0.0); };
  const int height = top + int(rows.size()) * row_h + 40;
  std::string s = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(left + width + 220) +
                  "\" height=\"" + std::to_string(height) + "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  s += "<text x=\"10\" y=\"20\" font-size=\"14\">" + escape(title) + "</text>\n";
  const bool chains = std::any_of(rows.begin(), rows.end(), [](const BarRow& r) { return r.chain > 0; });
  s += "<text x=\"10\" y=\"38\" fill=\"#555\">measured (blue) and floor (grey)" +
       std::string(chains ? ", kernels that only read the bytes (orange tick)" : "") + ", " + escape(unit) +
       ", log scale</text>\n";
  for (double d = l0; d <= l1; d += 1) {
    const double xv = x(std::pow(10.0, d));
    s += "<line x1=\"" + fmt("%.1f", xv) + "\" y1=\"" + std::to_string(top - 5) + "\" x2=\"" + fmt("%.1f", xv) +
         "\" y2=\"" + std::to_string(height - 35) + "\" stroke=\"#ddd\"/>\n";
    s += "<text x=\"" + fmt("%.1f", xv) + "\" y=\"" + std::to_string(height - 20) + "\" text-anchor=\"middle\">" +
         fmt("%g", std::pow(10.0, d)) + "</text>\n";
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const BarRow& r = rows[i];
    const int y = top + int(i) * row_h;
    s += "<text x=\"" + std::to_string(left - 6) + "\" y=\"" + std::to_string(y + 14) + "\" text-anchor=\"end\">" +
         escape(r.label) + "</text>\n";
    s += "<rect x=\"" + std::to_string(left) + "\" y=\"" + std::to_string(y) + "\" width=\"" +
         fmt("%.1f", std::max(0.0, x(r.measured) - left)) + "\" height=\"12\" fill=\"#3b73b9\"/>\n";
    if (r.floor > 0)
      s += "<rect x=\"" + std::to_string(left) + "\" y=\"" + std::to_string(y + 14) + "\" width=\"" +
           fmt("%.1f", std::max(0.0, x(r.floor) - left)) + "\" height=\"8\" fill=\"#999\"/>\n";
    if (r.chain > 0)
      s += "<line x1=\"" + fmt("%.1f", x(r.chain)) + "\" y1=\"" + std::to_string(y - 2) + "\" x2=\"" +
           fmt("%.1f", x(r.chain)) + "\" y2=\"" + std::to_string(y + 24) + "\" stroke=\"#e08a1e\" stroke-width=\"2\"/>\n";
    std::string note = fmt("%.1f", r.measured);
    if (r.floor > 0) note += fmt(" (%.1fx floor", r.measured / r.floor) + (r.chain > 0 ? fmt(", %.1fx reads)", r.measured / r.chain) : ")");
    else if (r.chain > 0) note += fmt(" (%.1fx reads)", r.measured / r.chain);
    s += "<text x=\"" + fmt("%.1f", x(r.measured) + 4) + "\" y=\"" + std::to_string(y + 11) + "\">" + note + "</text>\n";
  }
  return s + "</svg>\n";
}

}  // namespace kestrel::apps
