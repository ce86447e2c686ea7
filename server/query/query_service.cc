#include "server/query/query_service.h"

#include <deque>
#include <memory>
#include <mutex>

namespace foreshock::server {

namespace v1 = foreshock::v1;

namespace {

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

template <typename Response>
grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context,
                                 absl::StatusOr<Response> result, Response* response) {
  auto* reactor = context->DefaultReactor();
  if (result.ok()) *response = std::move(*result);
  reactor->Finish(ToGrpc(result.status()));
  return reactor;
}

}  // namespace

AccessCheck QueryService::Access(grpc::CallbackServerContext* context) const {
  if (authorizer_ == nullptr) return AccessCheck();
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  const std::string_view authorization =
      it == metadata.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
  return AccessCheck(authorizer_, auth_metrics_, "grpc_query", authorization);
}

grpc::ServerUnaryReactor* QueryService::ListAlerts(grpc::CallbackServerContext* context,
                                                   const v1::ListAlertsRequest* request,
                                                   v1::ListAlertsResponse* response) {
  return Answer(context, backend_.ListAlerts(*request, Access(context)), response);
}

grpc::ServerUnaryReactor* QueryService::ListRuns(grpc::CallbackServerContext* context,
                                                 const v1::ListRunsRequest*,
                                                 v1::ListRunsResponse* response) {
  return Answer(context, backend_.ListRuns(Access(context)), response);
}

grpc::ServerUnaryReactor* QueryService::ListSeries(grpc::CallbackServerContext* context,
                                                   const v1::ListSeriesRequest* request,
                                                   v1::ListSeriesResponse* response) {
  return Answer(context, backend_.ListSeries(*request, Access(context)), response);
}

namespace {
// Holds a GetSeries answer's memory lease until gRPC has sent the answer.
class LeasedReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit LeasedReactor(QueryBudget::Lease lease) : lease_(std::move(lease)) {}
  void OnDone() override { delete this; }

 private:
  QueryBudget::Lease lease_;
};
}  // namespace

grpc::ServerUnaryReactor* QueryService::GetSeries(grpc::CallbackServerContext* context,
                                                  const v1::GetSeriesRequest* request,
                                                  v1::GetSeriesResponse* response) {
  QueryBudget::Lease lease;
  absl::StatusOr<v1::GetSeriesResponse> result =
      backend_.GetSeries(*request, Access(context), &lease);
  if (result.ok()) {
    *response = std::move(*result);
  } else if (absl::IsUnavailable(result.status())) {
    // --max_query_total_mb is taken by other queries: retry after the hint.
    context->AddTrailingMetadata("retry-after-ms", std::to_string(QueryBudget::kRetryAfterMs));
  }
  auto* reactor = new LeasedReactor(std::move(lease));
  reactor->Finish(ToGrpc(result.status()));
  return reactor;
}

namespace {

// Streams alert events. The hub calls Push from worker threads; writes go out
// one at a time from the queue. Lifetime: the hub subscription holds a
// shared_ptr to the queue state, never to the reactor, so an event racing
// with the end of the stream is simply dropped.
class WatchReactor final : public grpc::ServerWriteReactor<v1::AlertEvent> {
 public:
  // `access` filters the events of a watch over every run (--token_file).
  WatchReactor(AlertHub& hub, DaemonMetrics& metrics, const v1::WatchAlertsRequest& request,
               std::shared_ptr<const AccessCheck> access)
      : hub_(hub), metrics_(metrics), state_(std::make_shared<State>()) {
    state_->reactor = this;
    std::weak_ptr<State> weak = state_;
    DaemonMetrics* m = &metrics_;
    subscription_ = hub_.Subscribe(request.run(), request.send_active(),
                                   [weak, m, access](const v1::AlertEvent& event) {
                                     if (access && !access->Allows(event.alert().run(), Right::kQuery)) return;
                                     if (auto state = weak.lock()) state->Push(event, *m);
                                   });
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->queue.pop_front();
    state_->writing = false;
    if (!ok) {
      state_->Close(grpc::Status::CANCELLED);
      return;
    }
    state_->WriteNextLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->Close(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    hub_.Unsubscribe(subscription_);
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->reactor = nullptr;
    }
    delete this;
  }

 private:
  struct State {
    std::mutex mu;
    WatchReactor* reactor = nullptr;  // null once the stream is done
    std::deque<v1::AlertEvent> queue;
    bool writing = false;
    bool closed = false;

    void Push(const v1::AlertEvent& event, DaemonMetrics& metrics) {
      std::lock_guard<std::mutex> lock(mu);
      if (closed || reactor == nullptr) return;
      if (queue.size() >= QueryService::kMaxWatchBacklog) {
        metrics.watch_events_dropped_total.Add({}).Increment();
        Close(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                           "watcher fell more than 4096 alert events behind; reconnect"));
        return;
      }
      queue.push_back(event);
      WriteNextLocked();
    }
    void WriteNextLocked() {
      if (writing || closed || queue.empty() || reactor == nullptr) return;
      writing = true;
      reactor->StartWrite(&queue.front());
    }
    void Close(const grpc::Status& status) {
      if (closed || reactor == nullptr) return;
      closed = true;
      reactor->Finish(status);
    }
  };

  AlertHub& hub_;
  DaemonMetrics& metrics_;
  std::shared_ptr<State> state_;
  uint64_t subscription_ = 0;
};

}  // namespace

grpc::ServerWriteReactor<v1::AlertEvent>* QueryService::WatchAlerts(
    grpc::CallbackServerContext* context, const v1::WatchAlertsRequest* request) {
  auto access = std::make_shared<const AccessCheck>(Access(context));
  absl::Status allowed = request->run().empty() ? access->authenticated()
                                                : access->Check(request->run(), Right::kQuery);
  if (request->run().empty() && !allowed.ok()) access->CountUnauthenticated();
  if (!allowed.ok()) {
    // A refused watch: a reactor that only finishes.
    class Refused final : public grpc::ServerWriteReactor<v1::AlertEvent> {
     public:
      explicit Refused(const grpc::Status& status) { Finish(status); }
      void OnDone() override { delete this; }
    };
    return new Refused(ToGrpc(allowed));
  }
  return new WatchReactor(alerts_, metrics_, *request,
                          authorizer_ ? std::move(access) : nullptr);
}

}  // namespace foreshock::server
