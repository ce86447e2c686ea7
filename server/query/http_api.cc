#include "server/query/http_api.h"

#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace foreshock::server {
namespace {

namespace v1 = foreshock::v1;

// Length of the well-formed UTF-8 sequence at text[i] (RFC 3629: no
// overlongs, no surrogates, nothing above U+10FFFF); 0 if there is none.
size_t Utf8SequenceLength(const std::string& text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b0 = byte(i);
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (b0 < 0x80) return 1;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > text.size()) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return n;
}

// A JSON string literal for any bytes: quotes, backslashes and control
// characters escaped, each byte that does not start a well-formed UTF-8
// sequence replaced by U+FFFD. Error messages quote client input (run names,
// query parameters), which may be anything.
std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const size_t n = Utf8SequenceLength(text, i);
    if (n == 0) {
      out += "\\ufffd";
      ++i;
      continue;
    }
    if (n > 1) {
      out.append(text, i, n);
      i += n;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7F) {
          char buffer[8];
          std::snprintf(buffer, sizeof buffer, "\\u%04x", c);
          out += buffer;
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  return out + "\"";
}

HttpResponse Error(const absl::Status& status) {
  int http = 500;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument: http = 400; break;
    case absl::StatusCode::kNotFound: http = 404; break;
    case absl::StatusCode::kResourceExhausted: http = 413; break;
    case absl::StatusCode::kUnavailable: http = 503; break;
    case absl::StatusCode::kUnauthenticated: http = 401; break;
    case absl::StatusCode::kPermissionDenied: http = 403; break;
    default: break;
  }
  return HttpResponse{http, "application/json",
                      absl::StrCat("{\"code\": ", JsonString(absl::StatusCodeToString(status.code())),
                                   ", \"error\": ", JsonString(std::string(status.message())),
                                   "}\n")};
}

HttpResponse Json(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string body;
  const auto status = google::protobuf::util::MessageToJsonString(message, &body, options);
  if (!status.ok()) {
    return Error(absl::InternalError(absl::StrCat("cannot encode JSON: ", status.ToString())));
  }
  return HttpResponse{200, "application/json", body + "\n"};
}

// A double as protobuf's JSON printer writes it: the shortest of %.15g and
// %.17g that reads back the same, and non-finite values as quoted names.
void AppendJsonDouble(std::string& out, double value) {
  if (std::isnan(value)) {
    out += "\"NaN\"";
  } else if (std::isinf(value)) {
    out += value > 0 ? "\"Infinity\"" : "\"-Infinity\"";
  } else {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.15g", value);
    if (std::strtod(buffer, nullptr) != value) std::snprintf(buffer, sizeof buffer, "%.17g", value);
    out += buffer;
  }
}

// GetSeriesResponse as JSON, the same bytes as Json() writes, with the
// points and buckets written here: protobuf's printer builds a tree of every
// field first (with always_print_primitive_fields), some 1.4 KB a point,
// which made one raw answer of 500k points take 730 MB.
HttpResponse SeriesJson(v1::GetSeriesResponse& series) {
  google::protobuf::RepeatedPtrField<v1::SeriesPoint> points;
  google::protobuf::RepeatedPtrField<v1::SeriesBucket> buckets;
  points.Swap(series.mutable_points());
  buckets.Swap(series.mutable_buckets());
  HttpResponse head = Json(series);  // "points":[],"buckets":[] (always printed)
  if (head.status != 200) return head;
  static constexpr std::string_view kPoints = "\"points\":[]", kBuckets = "\"buckets\":[]";
  const size_t at_points = head.body.find(kPoints);
  const size_t at_buckets = head.body.find(kBuckets);
  if (at_points == std::string::npos || at_buckets == std::string::npos || at_buckets < at_points) {
    return Error(absl::InternalError("cannot encode JSON: unexpected layout"));
  }
  std::string body;
  body.reserve(head.body.size() + 80 * static_cast<size_t>(points.size()) +
               160 * static_cast<size_t>(buckets.size()));
  body.append(head.body, 0, at_points);
  body += "\"points\":[";
  for (int i = 0; i < points.size(); ++i) {
    const v1::SeriesPoint& p = points[i];
    absl::StrAppend(&body, i > 0 ? "," : "", "{\"step\":\"", p.step(), "\",\"value\":");
    AppendJsonDouble(body, p.value());
    absl::StrAppend(&body, ",\"wall_time_unix_ms\":\"", p.wall_time_unix_ms(), "\"}");
  }
  points.Clear();
  body += "]";
  body.append(head.body, at_points + kPoints.size(), at_buckets - at_points - kPoints.size());
  body += "\"buckets\":[";
  for (int i = 0; i < buckets.size(); ++i) {
    const v1::SeriesBucket& b = buckets[i];
    absl::StrAppend(&body, i > 0 ? "," : "", "{\"first_step\":\"", b.first_step(),
                    "\",\"last_step\":\"", b.last_step(), "\",\"min\":");
    AppendJsonDouble(body, b.min());
    body += ",\"max\":";
    AppendJsonDouble(body, b.max());
    body += ",\"mean\":";
    AppendJsonDouble(body, b.mean());
    absl::StrAppend(&body, ",\"count\":\"", b.count(), "\",\"last\":");
    AppendJsonDouble(body, b.last());
    body += "}";
  }
  body += "]";
  body.append(head.body, at_buckets + kBuckets.size());
  head.body = std::move(body);
  return head;
}

template <typename T>
HttpResponse JsonOr(const absl::StatusOr<T>& result) {
  return result.ok() ? Json(*result) : Error(result.status());
}

// An optional integer query parameter: nullopt when absent, an error when malformed.
template <typename Int>
absl::StatusOr<std::optional<Int>> IntParam(const HttpRequest& request, const std::string& name) {
  auto it = request.query.find(name);
  if (it == request.query.end() || it->second.empty()) return std::optional<Int>();
  Int value;
  if (!absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("query parameter ", name, "='", it->second, "' is not an integer"));
  }
  return std::optional<Int>(value);
}

std::string Param(const HttpRequest& request, const std::string& name) {
  auto it = request.query.find(name);
  return it == request.query.end() ? std::string() : it->second;
}

}  // namespace

void AddApiRoutes(HttpServer& http, const QueryBackend& backend, const Authorizer* authorizer,
                  AuthMetrics* auth_metrics) {
  auto access = [authorizer, auth_metrics](const HttpRequest& request) {
    return authorizer ? AccessCheck(authorizer, auth_metrics, "http", request.authorization)
                      : AccessCheck();
  };
  http.AddRoute("/api/v1/runs", [&backend, access](const HttpRequest& request) {
    return JsonOr(backend.ListRuns(access(request)));
  });

  http.AddRoute("/api/v1/series", [&backend, access](const HttpRequest& request) {
    v1::ListSeriesRequest query;
    query.set_run(Param(request, "run"));
    return JsonOr(backend.ListSeries(query, access(request)));
  });

  http.AddRoute("/api/v1/points", [&backend, access](const HttpRequest& request) {
    v1::GetSeriesRequest query;
    query.set_run(Param(request, "run"));
    query.set_signal(Param(request, "signal"));
    auto layer = IntParam<int32_t>(request, "layer");
    auto head = IntParam<int32_t>(request, "head");
    auto from = IntParam<int64_t>(request, "from");
    auto to = IntParam<int64_t>(request, "to");
    auto max_points = IntParam<uint32_t>(request, "max_points");
    for (const absl::Status& s :
         {layer.status(), head.status(), from.status(), to.status(), max_points.status()}) {
      if (!s.ok()) return Error(s);
    }
    if (*layer) query.set_layer(**layer);
    if (*head) query.set_head(**head);
    if (*from) query.set_from_step(**from);
    if (*to) query.set_to_step(**to);
    if (*max_points) query.set_max_points(**max_points);
    QueryBudget::Lease lease;
    absl::StatusOr<v1::GetSeriesResponse> series = backend.GetSeries(query, access(request), &lease);
    if (!series.ok()) return Error(series.status());
    HttpResponse response = SeriesJson(*series);
    // The lease covers the answer until civetweb has written it.
    response.hold = std::make_shared<QueryBudget::Lease>(std::move(lease));
    return response;
  });

  http.AddRoute("/api/v1/alerts", [&backend, access](const HttpRequest& request) {
    v1::ListAlertsRequest query;
    query.set_run(Param(request, "run"));
    const std::string resolved = Param(request, "include_resolved");
    query.set_include_resolved(resolved == "true" || resolved == "1");
    return JsonOr(backend.ListAlerts(query, access(request)));
  });
}

}  // namespace foreshock::server
