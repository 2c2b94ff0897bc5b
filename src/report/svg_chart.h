// report/svg_chart.h: small, dependency-free line charts rendered as standalone SVG text.
//
// A LineChart holds named series of (x, y) points, optional shaded bands (a lower and an upper
// curve, e.g. the min/max of a ratio) and horizontal reference lines (e.g. 1.0). to_svg() lays out
// a title, a legend, a plot area with "nice" ticks (1, 2, 5 x 10^k) and grid lines, and draws each
// series as a polyline. The output is deterministic and self-contained (no scripts, no external
// fonts or styles), so it can be inlined into HTML or saved as a .svg file as is.
//
// Robustness rules (the metrics come from real runs):
//   - non-finite points (NaN, +-inf) are skipped; a series is broken into separate segments there;
//   - an empty chart renders an axis frame with a "no data" note;
//   - a single point or a constant series gets a padded range (no division by zero) and markers;
//   - every coordinate written is finite and rounded to 0.1 px.
// Thread-safety: a LineChart is a plain value; distinct objects can be used from distinct threads.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::report {

// When to draw a small circle at each point of a series.
enum class Markers {
  kAuto,  // when the series has few points (<= 40) or at isolated points
  kAlways,
  kNever,  // isolated points are still drawn, or they would be invisible
};

struct Series {
  std::string name;       // legend text
  std::vector<double> x;  // same length as y
  std::vector<double> y;
  std::string color;  // CSS colour; empty = the chart's palette, in order of addition
  double stroke_width = 1.8;
  bool dashed = false;
  Markers markers = Markers::kAuto;
};

// A shaded region between lo(x) and hi(x) at the same x values (e.g. min..max).
struct Band {
  std::string name;  // legend text
  std::vector<double> x;
  std::vector<double> lo;
  std::vector<double> hi;
  std::string color;  // fill colour; drawn with low opacity
};

struct ChartOptions {
  std::string title;
  std::string x_label = "step";
  std::string y_label;
  int width = 640;  // px (the viewBox; HTML may scale it)
  int height = 300;
  bool y_include_zero = false;  // extend the y range down (or up) to 0
  bool x_integer = true;        // x ticks at whole numbers only (steps)
};

class LineChart {
 public:
  explicit LineChart(ChartOptions options);

  LineChart& add_series(Series s);
  LineChart& add_band(Band b);
  // A dashed horizontal line at y, always inside the y range, labelled in the legend.
  LineChart& add_reference(double y, std::string label);

  // True when no series or band has a finite point.
  bool empty() const;
  const ChartOptions& options() const { return options_; }

  // The whole chart as an <svg> element with xmlns (valid as a standalone file).
  std::string to_svg() const;

 private:
  struct Reference {
    double y;
    std::string label;
  };
  ChartOptions options_;
  std::vector<Series> series_;
  std::vector<Band> bands_;
  std::vector<Reference> references_;
};

// Tick positions covering [lo, hi] with about `target` intervals, at multiples of 1, 2 or 5 x 10^k
// (integer_only: the step is at least 1). lo > hi is swapped; lo == hi is padded. The first tick is
// <= lo and the last >= hi.
std::vector<double> nice_ticks(double lo, double hi, int target, bool integer_only = false);

// A tick label for v on an axis with tick spacing `step`: just enough decimals to tell ticks apart,
// "k"/"M" suffixes for large round values, never "-0".
std::string format_tick(double v, double step);

// Text escaped for XML/HTML element content and attribute values.
std::string xml_escape(std::string_view s);

// Trailing moving average over the last `window` finite values (fewer at the start); non-finite
// inputs are skipped and give NaN outputs at their position. window < 1 is treated as 1.
std::vector<double> moving_average(const std::vector<double>& y, int window);

}  // namespace lorasync::report
