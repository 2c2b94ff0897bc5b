// http/async.h: the coroutine vocabulary of src/http (the narrowest Asio include).
// Every awaitable of this library runs on the executor of the coroutine that awaits it; a server
// handler runs on its connection's strand, so client calls made from it are serialised with the
// connection's other work (the cancellation callbacks rely on that).
#pragma once

#include <utility>  // before Asio's coroutine headers (Boost 1.74 + g++ 12)

#include <boost/asio/awaitable.hpp>

namespace lorasync::http {

template <typename T = void>
using Task = boost::asio::awaitable<T>;

}  // namespace lorasync::http
