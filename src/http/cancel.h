// http/cancel.h: a one-shot cancellation signal (client disconnect -> close the upstream call).
//
// fire() runs every subscribed callback once, in the firing thread, outside the lock; a callback
// subscribed after the fire runs at once. In the server, the signal of a request fires on that
// connection's strand, and client calls made from the handler subscribe from the same strand, so
// callbacks may touch that call's socket safely.
// Thread-safety: all members are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

namespace lorasync::http {

class CancelSignal {
 public:
  using Id = std::uint64_t;

  bool fired() const {
    std::lock_guard lk(mu_);
    return fired_;
  }
  void fire() {
    std::vector<std::pair<Id, std::function<void()>>> cbs;
    {
      std::lock_guard lk(mu_);
      if (fired_) return;
      fired_ = true;
      cbs.swap(cbs_);
    }
    for (auto& [id, f] : cbs) f();
  }
  Id subscribe(std::function<void()> f) {
    {
      std::lock_guard lk(mu_);
      if (!fired_) {
        cbs_.emplace_back(++next_, std::move(f));
        return next_;
      }
    }
    f();
    return 0;
  }
  void unsubscribe(Id id) {
    std::lock_guard lk(mu_);
    for (auto it = cbs_.begin(); it != cbs_.end(); ++it)
      if (it->first == id) {
        cbs_.erase(it);
        return;
      }
  }

 private:
  mutable std::mutex mu_;
  bool fired_ = false;
  Id next_ = 0;
  std::vector<std::pair<Id, std::function<void()>>> cbs_;
};

}  // namespace lorasync::http
