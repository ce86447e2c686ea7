// The HTTP JSON API on the metrics port, for the web UI and for scripts:
//
//   GET /api/v1/runs                                   ListRuns
//   GET /api/v1/series?run=R                           ListSeries
//   GET /api/v1/points?run=R&signal=S[&layer=L][&head=H][&from=A][&to=B][&max_points=N]
//                                                      GetSeries
//   GET /api/v1/alerts[?run=R][&include_resolved=true] ListAlerts
//
// Answers are the foreshock.v1.Query response messages in protobuf's JSON
// mapping with the proto field names (int64 values are JSON strings, as that
// mapping says). Errors: {"code": "NOT_FOUND", "error": "..."} with HTTP 400,
// 404 (a run the daemon has never seen, for /series, /points and
// /alerts?run=; an unknown series for /points) or 413; the error text may
// quote the request, and is valid JSON for any bytes in it (invalid UTF-8
// becomes U+FFFD). Every route also answers HEAD.
#pragma once

#include "server/http/http_server.h"
#include "server/query/query_backend.h"

namespace foreshock::server {

// With an `authorizer` (--token_file), every /api/v1 request needs
// `Authorization: Bearer <token>` with the query right for the runs it reads:
// 401 without a valid token, 403 for a run the token does not cover; /runs
// and /alerts without a run list only the runs it covers.
void AddApiRoutes(HttpServer& http, const QueryBackend& backend,
                  const Authorizer* authorizer = nullptr, AuthMetrics* auth_metrics = nullptr);

}  // namespace foreshock::server
