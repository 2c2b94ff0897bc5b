// The server's HTTP/1.1 request framing (see parse.h for what is refused and why).
#include "http/parse.h"

#include <algorithm>
#include <limits>

#include "http/http.h"

namespace lorasync::http {

namespace {

bool is_tchar(unsigned char c) {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return true;
  switch (c) {
    case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+': case '-': case '.':
    case '^': case '_': case '`': case '|': case '~':
      return true;
    default:
      return false;
  }
}

// field-vchar / obs-text / SP / HTAB (RFC 9110 §5.5).
bool is_field_char(unsigned char c) { return c == '\t' || (c >= 0x20 && c != 0x7f); }

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Calls f(element) for each element of a comma-separated list, OWS trimmed, empty ones skipped.
template <typename F>
void for_each_list_item(std::string_view list, F&& f) {
  while (!list.empty()) {
    const std::size_t comma = list.find(',');
    std::string_view item = trim_ows(list.substr(0, comma));
    if (!item.empty()) f(item);
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
}

ParseStatus fail(ParseError& err, int status, std::string message) {
  err.status = status;
  err.message = std::move(message);
  return ParseStatus::kError;
}

ParseStatus malformed(ParseError& err, std::string_view what) {
  return fail(err, 400, "malformed HTTP request: " + std::string(what));
}

}  // namespace

ParseStatus parse_request_head(std::string_view buf, std::size_t max_header_bytes, std::size_t scan_from,
                               RequestHead& out, ParseError& err) {
  out.clear();
  std::size_t start = 0;
  while (start + 1 < buf.size() && buf[start] == '\r' && buf[start + 1] == '\n') start += 2;
  if (start < buf.size() && buf[start] == '\n') return malformed(err, "line ends in a bare LF");
  const std::size_t from = std::max(start, scan_from > 3 ? scan_from - 3 : std::size_t{0});
  const std::size_t end = buf.find("\r\n\r\n", from);
  if (end == std::string_view::npos || end + 4 > max_header_bytes) {
    if (buf.size() > max_header_bytes || (end != std::string_view::npos && end + 4 > max_header_bytes))
      return fail(err, 431, "request headers exceed the limit of " + std::to_string(max_header_bytes) + " bytes");
    return ParseStatus::kIncomplete;
  }
  out.head_bytes = end + 4;
  std::string_view head = buf.substr(start, end + 2 - start);  // every line with its CRLF

  // One line without its CRLF; a CR or LF inside it is refused.
  auto next_line = [&](std::string_view& line) -> bool {
    const std::size_t crlf = head.find("\r\n");
    line = head.substr(0, crlf);
    head.remove_prefix(crlf + 2);
    return line.find_first_of("\r\n") == std::string_view::npos;
  };

  std::string_view line;
  if (!next_line(line)) return malformed(err, "bare CR or LF in the request line");
  // method SP request-target SP HTTP-version
  std::size_t i = 0;
  while (i < line.size() && is_tchar(static_cast<unsigned char>(line[i]))) ++i;
  if (i == 0 || i >= line.size() || line[i] != ' ') return malformed(err, "bad method in the request line");
  out.method = line.substr(0, i);
  const std::size_t t0 = ++i;
  while (i < line.size() && static_cast<unsigned char>(line[i]) > 0x20 && static_cast<unsigned char>(line[i]) < 0x7f) ++i;
  if (i == t0 || i >= line.size() || line[i] != ' ') return malformed(err, "bad request target");
  out.target = line.substr(t0, i - t0);
  const std::string_view version = line.substr(i + 1);
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || version[5] < '0' || version[5] > '9' ||
      version[6] != '.' || version[7] < '0' || version[7] > '9')
    return malformed(err, "bad HTTP version");
  if (version[5] != '1' || version[7] > '1')
    return fail(err, 505, "HTTP version " + std::string(version.substr(5)) + " is not supported (HTTP/1.0 and 1.1 are)");
  out.version_minor = version[7] - '0';
  out.keep_alive = out.version_minor == 1;

  bool close = false, keep_alive_token = false;
  int transfer_encodings = 0;
  bool te_other = false;
  std::string_view te_seen;
  while (!head.empty()) {
    if (!next_line(line)) return malformed(err, "bare CR or LF in a header line");
    if (line.front() == ' ' || line.front() == '\t') return malformed(err, "obsolete line folding in the headers");
    std::size_t n = 0;
    while (n < line.size() && is_tchar(static_cast<unsigned char>(line[n]))) ++n;
    if (n == 0 || n >= line.size() || line[n] != ':') return malformed(err, "bad header name");
    const std::string_view name = line.substr(0, n);
    const std::string_view value = trim_ows(line.substr(n + 1));
    for (char c : value)
      if (!is_field_char(static_cast<unsigned char>(c)))
        return malformed(err, "bad character in the value of header " + std::string(name));
    out.fields.emplace_back(name, value);

    if (iequals(name, "content-length")) {
      bool bad = false;
      bool any = false;
      for_each_list_item(value, [&](std::string_view v) {
        any = true;
        std::uint64_t x = 0;
        if (v.size() > 18) bad = true;  // beyond any limit, and no overflow below
        for (char c : v) {
          if (c < '0' || c > '9') bad = true;
          x = x * 10 + static_cast<std::uint64_t>(c - '0');
        }
        if (!bad && out.content_length && *out.content_length != x) bad = true;
        if (!bad) out.content_length = x;
      });
      if (bad || !any) return malformed(err, "bad Content-Length '" + std::string(value.substr(0, 40)) + "'");
    } else if (iequals(name, "transfer-encoding")) {
      for_each_list_item(value, [&](std::string_view v) {
        ++transfer_encodings;
        if (!iequals(v, "chunked")) {
          te_other = true;
          te_seen = v;
        }
      });
    } else if (iequals(name, "connection")) {
      for_each_list_item(value, [&](std::string_view v) {
        if (iequals(v, "close")) close = true;
        else if (iequals(v, "keep-alive")) keep_alive_token = true;
      });
    } else if (iequals(name, "expect")) {
      if (iequals(value, "100-continue")) out.expect_continue = true;
    }
  }
  if (transfer_encodings > 0) {
    if (out.version_minor == 0) return malformed(err, "Transfer-Encoding in an HTTP/1.0 request");
    if (te_other)
      return fail(err, 501, "Transfer-Encoding '" + std::string(te_seen.substr(0, 40)) + "' is not supported (only chunked)");
    if (transfer_encodings > 1) return malformed(err, "chunked applied more than once");
    if (out.content_length) return malformed(err, "both Content-Length and Transfer-Encoding");
    out.chunked = true;
  }
  if (out.version_minor == 0 && keep_alive_token) out.keep_alive = true;
  if (close) out.keep_alive = false;
  return ParseStatus::kDone;
}

ParseStatus ChunkedDecoder::feed(std::string_view in, std::string& body, std::size_t& consumed, ParseError& err) {
  consumed = 0;
  constexpr std::size_t kMaxLine = 4096;
  auto bad = [&](std::string_view what) { return malformed(err, "bad chunked body: " + std::string(what)); };
  while (consumed < in.size()) {
    if (state_ == State::kDone) return ParseStatus::kDone;
    if (state_ == State::kData) {
      const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(chunk_left_, in.size() - consumed));
      body.append(in.data() + consumed, take);
      consumed += take;
      chunk_left_ -= take;
      if (chunk_left_ == 0) state_ = State::kDataCr;
      continue;
    }
    const char c = in[consumed++];
    switch (state_) {
      case State::kSize: {
        int d = -1;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        if (d >= 0) {
          if (++size_digits_ > 15) return bad("chunk size too large");
          size_ = size_ * 16 + static_cast<std::uint64_t>(d);
        } else if (size_digits_ > 0 && (c == ';' || c == ' ' || c == '\t')) {
          state_ = State::kExt;
          line_bytes_ = 0;
        } else if (size_digits_ > 0 && c == '\r') {
          state_ = State::kSizeLf;
        } else {
          return bad("chunk size is not hexadecimal");
        }
        break;
      }
      case State::kExt:
        if (c == '\r') state_ = State::kSizeLf;
        else if (c == '\n' || (static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f) return bad("control character in a chunk extension");
        else if (++line_bytes_ > kMaxLine) return bad("chunk extension too long");
        break;
      case State::kSizeLf:
        if (c != '\n') return bad("chunk size line not ended by CRLF");
        if (size_ == 0) {
          state_ = State::kTrailer;
          line_bytes_ = 0;
          cr_ = false;
        } else {
          if (size_ > max_body_ || body.size() + size_ > max_body_) {
            err.status = 413;
            err.message = "request body exceeds " + std::to_string(max_body_) + " bytes";
            return ParseStatus::kError;
          }
          chunk_left_ = size_;
          state_ = State::kData;
        }
        size_ = 0;
        size_digits_ = 0;
        break;
      case State::kDataCr:
        if (c != '\r') return bad("chunk data not followed by CRLF");
        state_ = State::kDataLf;
        break;
      case State::kDataLf:
        if (c != '\n') return bad("chunk data not followed by CRLF");
        state_ = State::kSize;
        break;
      case State::kTrailer:
        if (cr_) {
          if (c != '\n') return bad("bare CR in the trailer section");
          cr_ = false;
          if (line_bytes_ == 0) {
            state_ = State::kDone;
            return ParseStatus::kDone;
          }
          line_bytes_ = 0;
        } else if (c == '\r') {
          cr_ = true;
        } else if (c == '\n' || (static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f) {
          return bad("control character in the trailer section");
        } else {
          ++line_bytes_;
          if (++trailer_bytes_ > max_trailer_) {
            err.status = 431;
            err.message = "request trailer section exceeds the limit of " + std::to_string(max_trailer_) + " bytes";
            return ParseStatus::kError;
          }
        }
        break;
      case State::kData:
      case State::kDone:
        break;
    }
  }
  return state_ == State::kDone ? ParseStatus::kDone : ParseStatus::kIncomplete;
}

}  // namespace lorasync::http
