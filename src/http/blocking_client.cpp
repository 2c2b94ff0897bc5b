#include "http/blocking_client.h"

#include <utility>  // before Asio's coroutine headers (Boost 1.74 + g++ 12)

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include "util/error.h"

namespace lorasync::http {

struct BlockingClient::Impl {
  boost::asio::io_context ctx;
  std::unique_ptr<Pool> pool;
  std::string token;
};

BlockingClient::BlockingClient(const std::string& base_url, std::string bearer_token, ClientOptions options)
    : impl_(std::make_unique<Impl>()), base_url_(base_url) {
  std::string err;
  auto url = Url::parse(base_url, err);
  if (!url) throw_invalid("bad server URL '{}': {}", base_url, err);
  impl_->pool = std::make_unique<Pool>(*url, options);
  impl_->token = std::move(bearer_token);
}

BlockingClient::~BlockingClient() {
  impl_->pool.reset();  // pooled sockets belong to ctx: release them first
}

Pool::Full BlockingClient::request(std::string_view method, std::string_view target, std::string_view body,
                                   double total_timeout_s, bool fresh_connection, std::string_view content_type) {
  Headers headers;
  if (!body.empty()) headers.add("Content-Type", std::string(content_type));
  if (!impl_->token.empty()) headers.add("Authorization", "Bearer " + impl_->token);
  OutRequest req{method, target, &headers, body};
  CallOptions opt;
  opt.total_timeout_s = total_timeout_s;
  opt.first_byte_timeout_s = total_timeout_s > 0 ? total_timeout_s : opt.first_byte_timeout_s;
  opt.fresh_connection = fresh_connection;
  Pool* pool = impl_->pool.get();
  auto task = [pool, req, opt]() -> Task<Pool::Full> { co_return co_await pool->fetch(req, opt); };
  auto fut = boost::asio::co_spawn(impl_->ctx, task(), boost::asio::use_future);
  impl_->ctx.restart();
  impl_->ctx.run();
  Pool::Full full = fut.get();
  if (full.error != CallError::kNone && full.message.empty()) full.message = call_error_name(full.error);
  if (full.error != CallError::kNone) full.status = 0;
  return full;
}

}  // namespace lorasync::http
