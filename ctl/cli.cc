#include "ctl/cli.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>

namespace foreshock::ctl {

bool Args::Flag(std::string_view name) const {
  auto it = values.find(std::string(name));
  return it != values.end() && it->second == "true";
}

std::string Args::Get(std::string_view name, std::string fallback) const {
  auto it = values.find(std::string(name));
  return it == values.end() ? fallback : it->second;
}

bool ParseArgs(int argc, const char* const* argv, int begin, const std::vector<OptionSpec>& specs,
               Args* args, std::string* error) {
  bool options_done = false;
  for (int i = begin; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (options_done || arg.size() < 2 || arg.substr(0, 2) != "--") {
      args->positional.emplace_back(arg);
      continue;
    }
    if (arg == "--") {
      options_done = true;
      continue;
    }
    std::string_view name = arg.substr(2);
    std::optional<std::string> value;
    if (const size_t eq = name.find('='); eq != std::string_view::npos) {
      value = std::string(name.substr(eq + 1));
      name = name.substr(0, eq);
    }
    const OptionSpec* spec = nullptr;
    for (const OptionSpec& s : specs) {
      if (s.name == name) spec = &s;
    }
    if (!spec) {
      *error = "unknown option --" + std::string(name);
      return false;
    }
    if (spec->takes_value) {
      if (!value) {
        if (i + 1 >= argc) {
          *error = "option --" + spec->name + " needs a value";
          return false;
        }
        value = argv[++i];
      }
    } else if (!value) {
      value = "true";
    } else if (*value != "true" && *value != "false") {
      *error = "option --" + spec->name + " is a switch: give it alone, or =true or =false";
      return false;
    }
    args->values[spec->name] = *value;
  }
  return true;
}

std::optional<int64_t> ParseInt(std::string_view text) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

std::string Table::Render() const {
  std::vector<size_t> widths(header_.size(), 0);
  auto widen = [&](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size() && i < widths.size(); ++i) {
      widths[i] = std::max(widths[i], row[i].size());
    }
  };
  widen(header_);
  for (const auto& row : rows_) widen(row);
  std::string out;
  auto line = [&](const std::vector<std::string>& row) {
    std::string text;
    for (size_t i = 0; i < widths.size(); ++i) {
      const std::string& cell = i < row.size() ? row[i] : std::string();
      text += cell;
      if (i + 1 < widths.size()) text += std::string(widths[i] - cell.size() + 2, ' ');
    }
    while (!text.empty() && text.back() == ' ') text.pop_back();
    out += text;
    out += '\n';
  };
  line(header_);
  for (const auto& row : rows_) line(row);
  return out;
}

std::string ExactNumber(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char text[64];
  auto [ptr, ec] = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, ptr);
}

std::string ShortNumber(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char text[64];
  std::snprintf(text, sizeof(text), "%.6g", value);
  return text;
}

std::string UtcTime(int64_t unix_ms) {
  if (unix_ms == 0) return "-";
  const std::time_t seconds = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

std::string SeriesCsv(const foreshock::v1::GetSeriesResponse& response) {
  std::string out;
  if (response.downsampled()) {
    out = "step,value,min,max,count,first_step,last_step,last\n";
    for (const auto& b : response.buckets()) {
      out += std::to_string(b.last_step()) + "," + ExactNumber(b.mean()) + "," +
             ExactNumber(b.min()) + "," + ExactNumber(b.max()) + "," + std::to_string(b.count()) +
             "," + std::to_string(b.first_step()) + "," + std::to_string(b.last_step()) + "," +
             ExactNumber(b.last()) + "\n";
    }
  } else {
    out = "step,value,wall_time_unix_ms\n";
    for (const auto& p : response.points()) {
      out += std::to_string(p.step()) + "," + ExactNumber(p.value()) + "," +
             std::to_string(p.wall_time_unix_ms()) + "\n";
    }
  }
  return out;
}

}  // namespace foreshock::ctl
