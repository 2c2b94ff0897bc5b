#include "http/http.h"

#include <arpa/inet.h>

#include <cctype>
#include <nlohmann/json.hpp>

#include "util/files.h"

namespace lorasync::http {

// ASCII case folding (field names and schemes are ASCII tokens): not std::tolower, which follows
// the process locale and is a call per byte (it was 0.6 % of the proxy's samples).
bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c + ('a' - 'A')) : c; };
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && lower(a[i]) != lower(b[i])) return false;
  return true;
}

void Headers::set(std::string_view name, std::string value) {
  remove(name);
  items_.push_back({std::string(name), std::move(value)});
}

void Headers::remove(std::string_view name) {
  std::erase_if(items_, [&](const Header& h) { return iequals(h.name, name); });
}

const std::string* Headers::find(std::string_view name) const {
  for (const auto& h : items_)
    if (iequals(h.name, name)) return &h.value;
  return nullptr;
}

std::string_view Request::path() const {
  std::string_view t = target;
  auto q = t.find('?');
  return q == std::string_view::npos ? t : t.substr(0, q);
}

std::string_view Request::query() const {
  std::string_view t = target;
  auto q = t.find('?');
  return q == std::string_view::npos ? std::string_view{} : t.substr(q + 1);
}

const char* reason_phrase(int s) {
  switch (s) {
    case 100: return "Continue";
    case 200: return "OK";
    case 201: return "Created";
    case 202: return "Accepted";
    case 204: return "No Content";
    case 301: return "Moved Permanently";
    case 302: return "Found";
    case 304: return "Not Modified";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 422: return "Unprocessable Content";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 507: return "Insufficient Storage";
    default: return "Unknown";
  }
}

std::string openai_error_json(int status, std::string_view message, std::string_view param,
                              std::string_view type) {
  nlohmann::json j;
  j["error"]["message"] = std::string(message);
  j["error"]["type"] = type.empty() ? (status < 500 ? "invalid_request_error" : "server_error") : std::string(type);
  j["error"]["param"] = param.empty() ? nlohmann::json(nullptr) : nlohmann::json(std::string(param));
  j["error"]["code"] = status;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Response error_response(int status, std::string_view message, std::string_view param, std::string_view type) {
  return json_response(status, openai_error_json(status, message, param, type));
}

std::string error_message_of(std::string_view body) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("error")) {
    const nlohmann::json& e = j["error"];
    if (e.is_object() && e.contains("message") && e["message"].is_string()) return e["message"].get<std::string>();
    if (e.is_string()) return e.get<std::string>();
  }
  return body.size() > 300 ? std::string(body.substr(0, 300)) + "..." : std::string(body);
}

Response json_response(int status, std::string body) {
  Response r;
  r.status = status;
  r.headers.add("Content-Type", "application/json");
  r.body = std::move(body);
  return r;
}

bool is_hop_by_hop(std::string_view n) {
  static constexpr std::string_view kNames[] = {"connection", "keep-alive", "proxy-connection",
                                                "proxy-authenticate", "proxy-authorization", "te",
                                                "trailer", "transfer-encoding", "upgrade"};
  for (std::string_view k : kNames)
    if (iequals(n, k)) return true;
  return false;
}

void strip_hop_by_hop(const Headers& in, Headers& out, std::span<const std::string_view> drop,
                      std::span<const std::pair<std::string_view, std::string_view>> append) {
  std::vector<std::string_view> listed;  // (allocates only when a Connection header lists names)
  for (const auto& h : in)
    if (iequals(h.name, "connection")) {
      std::string_view v = h.value;
      while (!v.empty()) {
        auto c = v.find(',');
        std::string_view tok = v.substr(0, c);
        while (!tok.empty() && (tok.front() == ' ' || tok.front() == '\t')) tok.remove_prefix(1);
        while (!tok.empty() && (tok.back() == ' ' || tok.back() == '\t')) tok.remove_suffix(1);
        if (!tok.empty()) listed.push_back(tok);
        if (c == std::string_view::npos) break;
        v.remove_prefix(c + 1);
      }
    }
  std::size_t k = 0;
  for (const auto& h : in) {
    if (is_hop_by_hop(h.name)) continue;
    bool named = false;
    for (const auto& l : listed) named |= iequals(l, h.name);
    for (const auto& d : drop) named |= iequals(d, h.name);
    if (named) continue;
    out.put_at(k++, h.name, h.value);
  }
  for (const auto& [name, value] : append) out.put_at(k++, name, value);
  out.truncate(k);
}

void Headers::put_at(std::size_t k, std::string_view name, std::string_view value) {
  if (k < items_.size()) {
    items_[k].name.assign(name);
    items_[k].value.assign(value);
  } else {
    items_.push_back(Header{std::string(name), std::string(value)});
  }
}

bool listed_in_connection(const Headers& in, std::string_view name) {
  for (const auto& h : in) {
    if (!iequals(h.name, "connection")) continue;
    std::string_view v = h.value;
    while (!v.empty()) {
      const auto c = v.find(',');
      std::string_view tok = v.substr(0, c);
      while (!tok.empty() && (tok.front() == ' ' || tok.front() == '\t')) tok.remove_prefix(1);
      while (!tok.empty() && (tok.back() == ' ' || tok.back() == '\t')) tok.remove_suffix(1);
      if (!tok.empty() && iequals(tok, name)) return true;
      if (c == std::string_view::npos) break;
      v.remove_prefix(c + 1);
    }
  }
  return false;
}

Headers strip_hop_by_hop(const Headers& in) {
  Headers out;
  strip_hop_by_hop(in, out);
  return out;
}

bool Url::is_loopback() const {
  if (iequals(host, "localhost")) return true;
  in_addr a4{};
  if (inet_pton(AF_INET, host.c_str(), &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  in6_addr a6{};
  if (inet_pton(AF_INET6, host.c_str(), &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
  return false;
}

std::string Url::host_header() const {
  std::string h = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  bool default_port = (tls() && port == 443) || (!tls() && port == 80);
  return default_port ? h : h + ":" + std::to_string(port);
}

std::string Url::str() const { return scheme + "://" + host_header() + prefix; }

std::optional<Url> Url::parse(std::string_view t, std::string& error) {
  Url u;
  auto sep = t.find("://");
  if (sep == std::string_view::npos) {
    error = "expected http://host[:port][/prefix] or https://...";
    return std::nullopt;
  }
  std::string scheme(t.substr(0, sep));
  for (auto& c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (scheme != "http" && scheme != "https") {
    error = "scheme must be http or https";
    return std::nullopt;
  }
  u.scheme = scheme;
  std::string_view rest = t.substr(sep + 3);
  if (rest.find_first_of("?#") != std::string_view::npos) {
    error = "no query or fragment allowed";
    return std::nullopt;
  }
  auto slash = rest.find('/');
  std::string_view authority = rest.substr(0, slash);
  std::string_view path = slash == std::string_view::npos ? std::string_view{} : rest.substr(slash);
  if (authority.find('@') != std::string_view::npos) {
    error = "no userinfo allowed";
    return std::nullopt;
  }
  std::string_view host, port;
  if (!authority.empty() && authority.front() == '[') {
    auto rb = authority.find(']');
    if (rb == std::string_view::npos) {
      error = "bad IPv6 host";
      return std::nullopt;
    }
    host = authority.substr(1, rb - 1);
    std::string_view after = authority.substr(rb + 1);
    if (!after.empty()) {
      if (after.front() != ':') {
        error = "bad authority";
        return std::nullopt;
      }
      port = after.substr(1);
    }
  } else {
    auto colon = authority.rfind(':');
    host = authority.substr(0, colon);
    if (colon != std::string_view::npos) port = authority.substr(colon + 1);
  }
  if (host.empty()) {
    error = "missing host";
    return std::nullopt;
  }
  for (char c : host)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' || c == '_')) {
      error = "bad character in host";
      return std::nullopt;
    }
  u.host = std::string(host);
  if (!port.empty() || authority.find(':') != std::string_view::npos) {
    if (port.empty() || port.size() > 5) {
      error = "bad port";
      return std::nullopt;
    }
    unsigned v = 0;
    for (char c : port) {
      if (!std::isdigit(static_cast<unsigned char>(c))) {
        error = "bad port";
        return std::nullopt;
      }
      v = v * 10 + static_cast<unsigned>(c - '0');
    }
    if (v == 0 || v > 65535) {
      error = "port out of range";
      return std::nullopt;
    }
    u.port = static_cast<std::uint16_t>(v);
  } else {
    u.port = u.tls() ? 443 : 80;
  }
  std::string p(path);
  while (!p.empty() && p.back() == '/') p.pop_back();
  u.prefix = p;
  return u;
}

std::string random_request_id() { return random_hex(16); }

}  // namespace lorasync::http
