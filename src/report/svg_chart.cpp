// report/svg_chart.cpp: layout and SVG text of LineChart.
//
// Layout, top to bottom: title, legend rows (wrapped to the plot width), plot area, x tick labels,
// x label. The left margin is sized from the widest y tick label. Text widths are estimated from
// character counts (no font metrics in a headless build), generously, so labels do not collide.
#include "report/svg_chart.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace lorasync::report {
namespace {

constexpr const char* kPalette[] = {"#2563eb", "#dc2626", "#16a34a", "#ea580c",
                                    "#7c3aed", "#0891b2", "#ca8a04", "#db2777"};
constexpr int kPaletteSize = static_cast<int>(sizeof(kPalette) / sizeof(kPalette[0]));
constexpr const char* kFont =
    "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif";
constexpr double kCharWidth = 6.4;  // px per character at 11 px, a little generous
constexpr double kTitleSize = 14;
constexpr double kLegendRow = 17;
constexpr std::size_t kAutoMarkerMaxPoints = 40;

bool finite(double v) {
  return std::isfinite(v);
}

// A coordinate, rounded to 0.1 px. Callers only pass finite values (checked ranges).
std::string px(double v) {
  if (!finite(v)) v = 0;  // unreachable by construction; never emit NaN into SVG
  double r = std::round(v * 10) / 10;
  if (r == 0) r = 0;  // no "-0.0"
  return fmt::format("{:.1f}", r);
}

double text_width(std::string_view s) {
  return static_cast<double>(s.size()) * kCharWidth;
}

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    if (!finite(v)) return;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool valid() const { return lo <= hi; }
};

// Splits indices [0, n) into maximal runs where ok(i) holds.
template <typename Pred>
std::vector<std::pair<std::size_t, std::size_t>> runs(std::size_t n, Pred ok) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  std::size_t i = 0;
  while (i < n) {
    while (i < n && !ok(i)) ++i;
    std::size_t start = i;
    while (i < n && ok(i)) ++i;
    if (i > start) out.emplace_back(start, i);
  }
  return out;
}

struct LegendItem {
  enum Kind { kLine, kDashed, kBand } kind;
  std::string label;
  std::string color;
  bool marker = false;
};

}  // namespace

std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        // Control characters are not allowed in XML 1.0; drop them (tabs/newlines kept).
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n' && c != '\r') break;
        out.push_back(c);
    }
  }
  return out;
}

std::vector<double> nice_ticks(double lo, double hi, int target, bool integer_only) {
  if (!finite(lo) || !finite(hi)) return {0.0, 1.0};
  if (lo > hi) std::swap(lo, hi);
  if (lo == hi) {
    double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    if (integer_only) pad = std::max(1.0, std::ceil(pad));
    lo -= pad;
    hi += pad;
  }
  target = std::max(1, target);
  double span = hi - lo;
  if (!finite(span) || span <= 0) return {lo, hi};
  double raw = span / target;
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double norm = raw / mag;
  double step = (norm < 1.5 ? 1.0 : norm < 3.0 ? 2.0 : norm < 7.0 ? 5.0 : 10.0) * mag;
  if (integer_only) step = std::max(1.0, std::round(step));
  double k0 = std::floor(lo / step + 1e-9);
  double k1 = std::ceil(hi / step - 1e-9);
  if (!finite(k0) || !finite(k1) || k1 - k0 > 1000) return {lo, hi};
  std::vector<double> ticks;
  for (double k = k0; k <= k1 + 0.5; k += 1) ticks.push_back(k * step);
  if (ticks.size() < 2) ticks.push_back(ticks.back() + step);
  return ticks;
}

std::string format_tick(double v, double step) {
  if (!finite(v)) return "";
  if (!(step > 0) || !finite(step)) step = 1;
  if (std::abs(v) < step * 1e-6) v = 0;
  std::string suffix;
  if (step >= 1e6) {
    v /= 1e6;
    step /= 1e6;
    suffix = "M";
  } else if (step >= 1e3) {
    v /= 1e3;
    step /= 1e3;
    suffix = "k";
  }
  int decimals = static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  decimals = std::clamp(decimals, 0, 10);
  std::string s = fmt::format("{:.{}f}", v, decimals);
  if (s.find_first_not_of("-0.") == std::string::npos && s.front() == '-') s.erase(0, 1);
  return s + suffix;
}

std::vector<double> moving_average(const std::vector<double>& y, int window) {
  window = std::max(1, window);
  std::vector<double> out(y.size(), std::numeric_limits<double>::quiet_NaN());
  std::vector<double> recent;  // the last `window` finite values, oldest first
  double sum = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    if (!finite(y[i])) continue;
    recent.push_back(y[i]);
    sum += y[i];
    if (recent.size() > static_cast<std::size_t>(window)) {
      sum -= recent.front();
      recent.erase(recent.begin());
    }
    // Recompute now and then to keep rounding drift away on long runs.
    if (i % 1024 == 0) {
      sum = 0;
      for (double r : recent) sum += r;
    }
    out[i] = sum / static_cast<double>(recent.size());
  }
  return out;
}

LineChart::LineChart(ChartOptions options) : options_(std::move(options)) {}

LineChart& LineChart::add_series(Series s) {
  series_.push_back(std::move(s));
  return *this;
}

LineChart& LineChart::add_band(Band b) {
  bands_.push_back(std::move(b));
  return *this;
}

LineChart& LineChart::add_reference(double y, std::string label) {
  if (finite(y)) references_.push_back({y, std::move(label)});
  return *this;
}

bool LineChart::empty() const {
  for (const auto& s : series_) {
    std::size_t n = std::min(s.x.size(), s.y.size());
    for (std::size_t i = 0; i < n; ++i)
      if (finite(s.x[i]) && finite(s.y[i])) return false;
  }
  for (const auto& b : bands_) {
    std::size_t n = std::min({b.x.size(), b.lo.size(), b.hi.size()});
    for (std::size_t i = 0; i < n; ++i)
      if (finite(b.x[i]) && finite(b.lo[i]) && finite(b.hi[i])) return false;
  }
  return true;
}

std::string LineChart::to_svg() const {
  const ChartOptions& o = options_;
  const double W = std::max(200, o.width);
  const double H = std::max(150, o.height);
  const bool no_data = empty();

  // Colours: explicit ones kept, the rest from the palette in order of addition.
  int next_colour = 0;
  auto pick = [&](const std::string& c) {
    if (!c.empty()) return c;
    return std::string(kPalette[next_colour++ % kPaletteSize]);
  };
  std::vector<std::string> band_colour, series_colour;
  for (const auto& b : bands_) band_colour.push_back(pick(b.color));
  for (const auto& s : series_) series_colour.push_back(pick(s.color));

  // Data ranges (finite points only; references are always inside the y range).
  Range xr, yr;
  for (const auto& s : series_) {
    std::size_t n = std::min(s.x.size(), s.y.size());
    for (std::size_t i = 0; i < n; ++i)
      if (finite(s.x[i]) && finite(s.y[i])) {
        xr.add(s.x[i]);
        yr.add(s.y[i]);
      }
  }
  for (const auto& b : bands_) {
    std::size_t n = std::min({b.x.size(), b.lo.size(), b.hi.size()});
    for (std::size_t i = 0; i < n; ++i)
      if (finite(b.x[i]) && finite(b.lo[i]) && finite(b.hi[i])) {
        xr.add(b.x[i]);
        yr.add(b.lo[i]);
        yr.add(b.hi[i]);
      }
  }
  if (!no_data)
    for (const auto& r : references_) yr.add(r.y);
  if (!xr.valid()) xr = {0, 1};
  if (!yr.valid()) yr = {0, 1};
  if (o.y_include_zero) {
    yr.lo = std::min(yr.lo, 0.0);
    yr.hi = std::max(yr.hi, 0.0);
  }
  // All zeros on a zero-based axis: show 0..1 (not -1..1), without headroom.
  const bool all_zero = o.y_include_zero && yr.lo == 0 && yr.hi == 0;
  if (all_zero) yr.hi = 1;
  // A little headroom so lines do not run along the frame; none beyond an included zero.
  if (yr.hi > yr.lo && !all_zero) {
    double pad = (yr.hi - yr.lo) * 0.04;
    if (!(o.y_include_zero && yr.lo == 0)) yr.lo -= pad;
    if (!(o.y_include_zero && yr.hi == 0)) yr.hi += pad;
  }
  std::vector<double> xt = nice_ticks(xr.lo, xr.hi, 6, o.x_integer);
  std::vector<double> yt = nice_ticks(yr.lo, yr.hi, 5, false);
  const double x0 = xt.front(), x1 = xt.back(), y0 = yt.front(), y1 = yt.back();
  const double x_step = xt.size() > 1 ? xt[1] - xt[0] : 1.0;
  const double y_step = yt.size() > 1 ? yt[1] - yt[0] : 1.0;

  // Margins.
  double widest_y_label = 0;
  for (double t : yt) widest_y_label = std::max(widest_y_label, text_width(format_tick(t, y_step)));
  const double left = std::max(44.0, widest_y_label + 14 + (o.y_label.empty() ? 0 : 16));
  const double right = 18;
  const double plot_w = W - left - right;

  // Legend items and their wrapped rows.
  std::vector<LegendItem> legend;
  for (std::size_t i = 0; i < bands_.size(); ++i)
    if (!bands_[i].name.empty())
      legend.push_back({LegendItem::kBand, bands_[i].name, band_colour[i], false});
  for (std::size_t i = 0; i < series_.size(); ++i)
    if (!series_[i].name.empty())
      legend.push_back({series_[i].dashed ? LegendItem::kDashed : LegendItem::kLine,
                        series_[i].name, series_colour[i], series_[i].markers == Markers::kAlways});
  for (const auto& r : references_)
    if (!r.label.empty()) legend.push_back({LegendItem::kDashed, r.label, "#6b7280", false});
  std::vector<std::vector<std::pair<const LegendItem*, double>>> rows;  // item, x offset
  {
    double x = 0;
    for (const auto& item : legend) {
      double w = 22 + text_width(item.label) + 18;
      if (rows.empty() || (x + w > plot_w && x > 0)) {
        rows.emplace_back();
        x = 0;
      }
      rows.back().emplace_back(&item, x);
      x += w;
    }
  }
  const double legend_top = 30;
  const double top = legend_top + static_cast<double>(rows.size()) * kLegendRow + 8;
  const double bottom = o.x_label.empty() ? 28 : 44;
  const double plot_h = std::max(40.0, H - top - bottom);
  const double H_total = top + plot_h + bottom;

  auto sx = [&](double x) { return left + (x - x0) / (x1 - x0) * plot_w; };
  auto sy = [&](double y) { return top + plot_h - (y - y0) / (y1 - y0) * plot_h; };

  std::string out;
  out.reserve(8192);
  out += fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "font-family=\"{}\" font-size=\"11\" role=\"img\">\n",
      px(W), px(H_total), px(W), px(H_total), kFont);
  out += fmt::format("<title>{}</title>\n", xml_escape(o.title));
  out += fmt::format("<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n", px(W),
                     px(H_total));
  out += fmt::format(
      "<text x=\"{}\" y=\"20\" font-size=\"{}\" font-weight=\"600\" fill=\"#111827\">{}</text>\n",
      px(left), kTitleSize, xml_escape(o.title));

  // Legend.
  for (std::size_t r = 0; r < rows.size(); ++r) {
    double cy = legend_top + static_cast<double>(r) * kLegendRow + 6;
    for (const auto& [item, dx] : rows[r]) {
      double lx = left + dx;
      switch (item->kind) {
        case LegendItem::kBand:
          out += fmt::format(
              "<rect x=\"{}\" y=\"{}\" width=\"18\" height=\"9\" fill=\"{}\" fill-opacity=\"0.2\" "
              "stroke=\"{}\" stroke-opacity=\"0.5\"/>\n",
              px(lx), px(cy - 4.5), item->color, item->color);
          break;
        case LegendItem::kLine:
        case LegendItem::kDashed:
          out += fmt::format(
              "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" "
              "stroke-width=\"2\"{}/>\n",
              px(lx), px(cy), px(lx + 18), px(cy), item->color,
              item->kind == LegendItem::kDashed ? " stroke-dasharray=\"4 3\"" : "");
          if (item->marker)
            out += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"2.5\" fill=\"{}\"/>\n", px(lx + 9),
                               px(cy), item->color);
          break;
      }
      out += fmt::format("<text x=\"{}\" y=\"{}\" fill=\"#374151\">{}</text>\n", px(lx + 22),
                         px(cy + 4), xml_escape(item->label));
    }
  }

  // Grid, frame and ticks.
  out += "<g stroke=\"#e5e7eb\" stroke-width=\"1\">\n";
  for (double t : yt)
    out += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>\n", px(left), px(sy(t)),
                       px(left + plot_w), px(sy(t)));
  for (double t : xt)
    out += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>\n", px(sx(t)), px(top),
                       px(sx(t)), px(top + plot_h));
  out += "</g>\n";
  out += fmt::format(
      "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#9ca3af\"/>\n",
      px(left), px(top), px(plot_w), px(plot_h));
  out += "<g fill=\"#4b5563\">\n";
  for (double t : yt)
    out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n", px(left - 6),
                       px(sy(t) + 4), format_tick(t, y_step));
  for (double t : xt)
    out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", px(sx(t)),
                       px(top + plot_h + 16), format_tick(t, x_step));
  out += "</g>\n";
  if (!o.x_label.empty())
    out +=
        fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#6b7280\">{}</text>\n",
                    px(left + plot_w / 2), px(top + plot_h + 34), xml_escape(o.x_label));
  if (!o.y_label.empty()) {
    double cx = 13, cy = top + plot_h / 2;
    out += fmt::format(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#6b7280\" "
        "transform=\"rotate(-90 {} {})\">{}</text>\n",
        px(cx), px(cy), px(cx), px(cy), xml_escape(o.y_label));
  }

  if (no_data) {
    out += fmt::format(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#9ca3af\" font-size=\"13\">"
        "no data</text>\n",
        px(left + plot_w / 2), px(top + plot_h / 2));
    out += "</svg>\n";
    return out;
  }

  // Bands: one polygon per run of finite points (upper edge forward, lower edge back).
  for (std::size_t bi = 0; bi < bands_.size(); ++bi) {
    const Band& b = bands_[bi];
    const std::string& c = band_colour[bi];
    std::size_t n = std::min({b.x.size(), b.lo.size(), b.hi.size()});
    auto ok = [&](std::size_t i) { return finite(b.x[i]) && finite(b.lo[i]) && finite(b.hi[i]); };
    for (auto [s, e] : runs(n, ok)) {
      if (e - s == 1) {
        out += fmt::format(
            "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{}\" stroke-opacity=\"0.45\" "
            "stroke-width=\"4\"/>\n",
            px(sx(b.x[s])), px(sy(b.lo[s])), px(sx(b.x[s])), px(sy(b.hi[s])), c);
        continue;
      }
      std::string pts, hi_pts, lo_pts;
      for (std::size_t i = s; i < e; ++i) {
        hi_pts += fmt::format("{},{} ", px(sx(b.x[i])), px(sy(b.hi[i])));
        lo_pts += fmt::format("{},{} ", px(sx(b.x[i])), px(sy(b.lo[i])));
      }
      pts = hi_pts;
      for (std::size_t i = e; i-- > s;)
        pts += fmt::format("{},{} ", px(sx(b.x[i])), px(sy(b.lo[i])));
      pts.pop_back();
      hi_pts.pop_back();
      lo_pts.pop_back();
      out += fmt::format("<polygon points=\"{}\" fill=\"{}\" fill-opacity=\"0.16\"/>\n", pts, c);
      for (const std::string* edge : {&hi_pts, &lo_pts})
        out += fmt::format(
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-opacity=\"0.45\" "
            "stroke-width=\"1\"/>\n",
            *edge, c);
    }
  }

  // References.
  for (const auto& r : references_)
    out += fmt::format(
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#6b7280\" stroke-width=\"1.2\" "
        "stroke-dasharray=\"4 3\"/>\n",
        px(left), px(sy(r.y)), px(left + plot_w), px(sy(r.y)));

  // Series: a polyline per run of finite points; markers as configured.
  for (std::size_t si = 0; si < series_.size(); ++si) {
    const Series& s = series_[si];
    const std::string& c = series_colour[si];
    std::size_t n = std::min(s.x.size(), s.y.size());
    auto ok = [&](std::size_t i) { return finite(s.x[i]) && finite(s.y[i]); };
    std::size_t n_finite = 0;
    for (std::size_t i = 0; i < n; ++i) n_finite += ok(i) ? 1 : 0;
    bool all_markers = s.markers == Markers::kAlways ||
                       (s.markers == Markers::kAuto && n_finite <= kAutoMarkerMaxPoints);
    std::string circles;
    for (auto [b, e] : runs(n, ok)) {
      if (e - b > 1) {
        std::string pts;
        for (std::size_t i = b; i < e; ++i)
          pts += fmt::format("{},{} ", px(sx(s.x[i])), px(sy(s.y[i])));
        pts.pop_back();
        out += fmt::format(
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"{}\" "
            "stroke-linejoin=\"round\" stroke-linecap=\"round\"{}/>\n",
            pts, c, px(s.stroke_width), s.dashed ? " stroke-dasharray=\"5 3\"" : "");
      }
      if (all_markers || e - b == 1)
        for (std::size_t i = b; i < e; ++i)
          circles += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"{}\"/>\n", px(sx(s.x[i])),
                                 px(sy(s.y[i])), e - b == 1 ? "3" : "2.2");
    }
    if (!circles.empty()) out += fmt::format("<g fill=\"{}\">\n{}</g>\n", c, circles);
  }
  out += "</svg>\n";
  return out;
}

}  // namespace lorasync::report
