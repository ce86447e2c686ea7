// foreshockctl's pieces that need no daemon: argument parsing, aligned
// tables, number and time formatting, and the CSV form of GetSeries.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "foreshock/v1/query.pb.h"

namespace foreshock::ctl {

// ---------------------------------------------------------------- arguments

struct OptionSpec {
  std::string name;  // without the leading "--"
  bool takes_value = false;
};

// "--name=value", "--name value" and, for booleans, "--name" (also
// "--name=true|false"). Options may come before or after positionals; "--"
// ends the options.
struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::string> values;  // options given, by name (booleans: "true"/"false")

  bool Has(std::string_view name) const { return values.count(std::string(name)) > 0; }
  bool Flag(std::string_view name) const;
  std::string Get(std::string_view name, std::string fallback = "") const;
};

// Fills *args from argv[begin..argc). False with *error for an unknown
// option, a missing value or a malformed boolean.
bool ParseArgs(int argc, const char* const* argv, int begin, const std::vector<OptionSpec>& specs,
               Args* args, std::string* error);

// Strict integer parsing (the whole text, in range). nullopt otherwise.
std::optional<int64_t> ParseInt(std::string_view text);

// ---------------------------------------------------------------- formatting

// Rows of cells printed with every column padded to its widest cell (the
// last column is not padded), two spaces apart.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void AddRow(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  size_t rows() const { return rows_.size(); }
  std::string Render() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// The shortest text that reads back as the same double ("nan", "inf", "-inf"
// for non-finite values): for CSV, so that values survive a round trip.
std::string ExactNumber(double value);
// Six significant digits: for tables.
std::string ShortNumber(double value);
// Unix milliseconds as "2024-05-01T12:00:00Z"; "-" for 0.
std::string UtcTime(int64_t unix_ms);

// GetSeries as CSV, one header line then one line per point or bucket:
//   raw points:  step,value,wall_time_unix_ms
//   downsampled: step,value,min,max,count,first_step,last_step,last
// For a bucket, step is its last_step and value its mean, so that a plot of
// (step, value) reads the same either way.
std::string SeriesCsv(const foreshock::v1::GetSeriesResponse& response);

}  // namespace foreshock::ctl
