#include "server/query_service.h"

#include <deque>
#include <memory>
#include <mutex>

namespace foreshock::server {

namespace v1 = foreshock::v1;

grpc::ServerUnaryReactor* QueryService::ListAlerts(grpc::CallbackServerContext* context,
                                                   const v1::ListAlertsRequest* request,
                                                   v1::ListAlertsResponse* response) {
  for (v1::Alert& alert : alerts_.Alerts(request->run(), request->include_resolved())) {
    *response->add_alerts() = std::move(alert);
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

namespace {

// Streams alert events. The hub calls Push from worker threads; writes go out
// one at a time from the queue. Lifetime: the hub subscription holds a
// shared_ptr to the queue state, never to the reactor, so an event racing
// with the end of the stream is simply dropped.
class WatchReactor final : public grpc::ServerWriteReactor<v1::AlertEvent> {
 public:
  WatchReactor(AlertHub& hub, DaemonMetrics& metrics, const v1::WatchAlertsRequest& request)
      : hub_(hub), metrics_(metrics), state_(std::make_shared<State>()) {
    state_->reactor = this;
    std::weak_ptr<State> weak = state_;
    DaemonMetrics* m = &metrics_;
    subscription_ = hub_.Subscribe(request.run(), request.send_active(),
                                   [weak, m](const v1::AlertEvent& event) {
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
  return new WatchReactor(alerts_, metrics_, *request);
}

}  // namespace foreshock::server
