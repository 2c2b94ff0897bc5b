// http/blocking_client.h: a synchronous facade over the async client (client.h) for callers that
// run on their own plain thread: the trainer's sync thread and start-up probes, `lorasync eval`.
// Each BlockingClient owns an io_context and one keep-alive Pool for one base URL; request() runs
// the call to completion on the calling thread. Optional bearer token on every request.
// Thread-safety: one BlockingClient per thread.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "http/client.h"

namespace lorasync::http {

class BlockingClient {
 public:
  // InvalidInput naming the URL when it does not parse.
  explicit BlockingClient(const std::string& base_url, std::string bearer_token = {},
                          ClientOptions options = {});
  ~BlockingClient();
  BlockingClient(const BlockingClient&) = delete;
  BlockingClient& operator=(const BlockingClient&) = delete;

  // status 0 with `message` set on a transport failure (connect, timeout, reset).
  Pool::Full request(std::string_view method, std::string_view target, std::string_view body = {},
                     double total_timeout_s = 60, bool fresh_connection = false,
                     std::string_view content_type = "application/json");
  const std::string& base_url() const { return base_url_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string base_url_;
};

}  // namespace lorasync::http
