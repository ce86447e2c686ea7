// Small string helpers for the alert engine's messages. (Debian's Abseil is
// built with its own string_view, so absl::StrCat does not take
// std::string_view; these do.)
#pragma once

#include <sstream>
#include <string>
#include <string_view>

namespace foreshock::alerts::internal {

// Concatenates anything an ostream prints (numbers with up to 6 significant digits).
template <typename... Args>
std::string Cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

template <typename Container>
std::string Join(const Container& items, std::string_view separator) {
  std::string joined;
  for (const auto& item : items) {
    if (!joined.empty()) joined += separator;
    joined += item;
  }
  return joined;
}

}  // namespace foreshock::alerts::internal
