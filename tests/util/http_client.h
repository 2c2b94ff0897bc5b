// tests/util/http_client.h: a small blocking HTTP/1.1 client for black-box tests (loopback, or a
// test's own network namespace):
// one request per connection (Connection: close), chunked bodies decoded, SSE events split.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace lorasync::testing {

struct HttpResult {
  int status = 0;  // 0 = transport failure
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
};

inline std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The same to an IPv4 address other than loopback (e.g. inside a test's network namespace).
inline HttpResult http_request_at(const std::string& ipv4, std::uint16_t port, const std::string& method,
                                  const std::string& path, const std::string& body = "",
                                  const std::vector<std::string>& extra_headers = {}, int timeout_s = 120);

inline HttpResult http_request(std::uint16_t port, const std::string& method, const std::string& path,
                               const std::string& body = "",
                               const std::vector<std::string>& extra_headers = {}, int timeout_s = 120) {
  return http_request_at("127.0.0.1", port, method, path, body, extra_headers, timeout_s);
}

inline HttpResult http_request_at(const std::string& ipv4, std::uint16_t port, const std::string& method,
                                  const std::string& path, const std::string& body,
                                  const std::vector<std::string>& extra_headers, int timeout_s) {
  HttpResult r;
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return r;
  timeval tv{timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (inet_pton(AF_INET, ipv4.c_str(), &a.sin_addr) != 1) {
    ::close(fd);
    return r;
  }
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return r;
  }
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  for (const auto& h : extra_headers) req += h + "\r\n";
  if (!body.empty() || method == "POST")
    req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  req += "\r\n" + body;
  std::size_t off = 0;
  while (off < req.size()) {
    ssize_t n = ::send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;  // a signal (a child exiting) is not the end of the call
    if (n <= 0) break;
    off += static_cast<std::size_t>(n);
  }
  std::string raw;
  char buf[65536];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    raw.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  auto hdr_end = raw.find("\r\n\r\n");
  if (hdr_end == std::string::npos) return r;
  std::string head = raw.substr(0, hdr_end);
  std::string rest = raw.substr(hdr_end + 4);
  auto sp = head.find(' ');
  r.status = std::atoi(head.c_str() + sp + 1);
  std::size_t pos = head.find("\r\n");
  while (pos != std::string::npos) {
    std::size_t next = head.find("\r\n", pos + 2);
    std::string line = head.substr(pos + 2, next == std::string::npos ? std::string::npos : next - pos - 2);
    auto c = line.find(':');
    if (c != std::string::npos) {
      std::string v = line.substr(c + 1);
      while (!v.empty() && v.front() == ' ') v.erase(0, 1);
      r.headers[lower(line.substr(0, c))] = v;
    }
    pos = next;
  }
  if (lower(r.headers["transfer-encoding"]) == "chunked") {
    std::size_t p = 0;
    while (p < rest.size()) {
      auto e = rest.find("\r\n", p);
      if (e == std::string::npos) break;
      std::size_t n = std::stoul(rest.substr(p, e - p), nullptr, 16);
      if (n == 0) break;
      r.body += rest.substr(e + 2, n);
      p = e + 2 + n + 2;
    }
  } else {
    r.body = rest;
  }
  return r;
}

// "data: ..." payloads of an SSE body, in order.
inline std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> out;
  std::size_t p = 0;
  while ((p = body.find("data: ", p)) != std::string::npos) {
    auto e = body.find("\n\n", p);
    out.push_back(body.substr(p + 6, e == std::string::npos ? std::string::npos : e - p - 6));
    if (e == std::string::npos) break;
    p = e + 2;
  }
  return out;
}

}  // namespace lorasync::testing
