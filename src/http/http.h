// http/http.h: plain HTTP/1.1 message types shared by the server and the client, URL parsing,
// and the OpenAI-shaped error helpers. No Boost in this header: include it anywhere.
//
// Error shape (http-api.md): {"error": {"message", "type", "param", "code"}}; `type` is
// invalid_request_error for 4xx and the caller's choice (e.g. proxy_error, server_error) for 5xx.
// Thread-safety: value types; free functions are thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace lorasync::http {

bool iequals(std::string_view a, std::string_view b);

struct Header {
  std::string name;
  std::string value;
};

// Ordered header list; repeated names keep their order (Set-Cookie). Lookups are
// case-insensitive.
class Headers {
 public:
  void add(std::string name, std::string value) { items_.push_back({std::move(name), std::move(value)}); }
  // Replaces every header of that name with one.
  void set(std::string_view name, std::string value);
  // Entry k becomes (name, value), reusing its strings' capacity, or is appended when k == size();
  // then truncate(n) drops what lies past n. Headers kept from call to call are thus copied into
  // without allocating once their strings are large enough.
  void put_at(std::size_t k, std::string_view name, std::string_view value);
  void truncate(std::size_t n) { items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(n), items_.end()); }
  void remove(std::string_view name);
  // First value of `name`, or nullptr.
  const std::string* find(std::string_view name) const;
  bool has(std::string_view name) const { return find(name) != nullptr; }
  std::size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }
  std::vector<Header>& items() { return items_; }
  const std::vector<Header>& items() const { return items_; }

 private:
  std::vector<Header> items_;
};

struct Request {
  std::string method;  // "GET", "POST", ...
  std::string target;  // origin-form: path + optional "?query"
  Headers headers;     // as received (no Content-Length/Transfer-Encoding handling needed)
  std::string body;    // whole body (bounded by the server's max body size)
  std::string remote;  // peer "ip:port"
  std::string_view path() const;
  std::string_view query() const;  // without '?', empty if none
};

struct Response {
  int status = 200;
  Headers headers;   // framing headers (Content-Length, Transfer-Encoding, Connection) are ignored
  std::string body;
};

const char* reason_phrase(int status);

// {"error": {"message": ..., "type": ..., "param": ..., "code": status}}. type defaults to
// invalid_request_error (< 500) or server_error (>= 500); param null when empty.
std::string openai_error_json(int status, std::string_view message, std::string_view param = {},
                              std::string_view type = {});
Response error_response(int status, std::string_view message, std::string_view param = {},
                        std::string_view type = {});
Response json_response(int status, std::string body);
// The message of an error body ({"error": {"message": ...}} or {"error": "..."}), else the body
// itself, cut to 300 characters.
std::string error_message_of(std::string_view body);

// Headers that never cross a proxy (RFC 9110 §7.6.1) plus every name listed in `Connection`.
bool is_hop_by_hop(std::string_view name);
// Copies `in` without hop-by-hop headers and without those named in its Connection values.
Headers strip_hop_by_hop(const Headers& in);
// The same into `out` (replacing its contents), reusing its strings' capacity: with an `out` kept
// from call to call, copying a response's headers allocates nothing once the strings are large enough.
// Also left out: the names in `drop` (lower case, compared case-insensitively); then `append` is
// added at the end, in the same reused strings.
void strip_hop_by_hop(const Headers& in, Headers& out, std::span<const std::string_view> drop = {},
                      std::span<const std::pair<std::string_view, std::string_view>> append = {});
// Whether a Connection header of `in` lists `name` (case-insensitive): such a header is hop-by-hop.
bool listed_in_connection(const Headers& in, std::string_view name);

// http(s)://host[:port][/prefix]. No userinfo, query or fragment; trailing '/' dropped.
struct Url {
  std::string scheme;  // "http" | "https"
  std::string host;    // without brackets for IPv6
  std::uint16_t port = 0;
  std::string prefix;  // "" or "/something" (no trailing '/')
  bool tls() const { return scheme == "https"; }
  bool is_loopback() const;  // localhost, 127.0.0.0/8, ::1
  std::string str() const;   // normalised form
  std::string host_header() const;
  // Parses; on failure returns nullopt and sets `error`.
  static std::optional<Url> parse(std::string_view text, std::string& error);
};

// Decimal seconds to a duration check helper: "0 means off" handled by callers.
std::string random_request_id();  // 128 random bits in hex

}  // namespace lorasync::http
