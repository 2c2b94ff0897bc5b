// http/parse.h: the HTTP/1.1 request framing of the server (RFC 9112), without Boost and without
// allocation in the head parser: the request line and header fields are views into the caller's
// buffer, and the chunked-body decoder is a small state machine fed whatever bytes arrived.
//
// Strictness (request smuggling and desync are the risks of a front proxy):
//   - lines end in CRLF; a bare CR or LF, a NUL or another control character is refused;
//   - header names are tokens with no space before the colon; obsolete line folding is refused;
//   - Content-Length is digits only, repeated values must agree, and it may not be combined with
//     Transfer-Encoding; a Transfer-Encoding other than exactly "chunked" is refused (501), as is
//     any Transfer-Encoding on HTTP/1.0;
//   - only HTTP/1.0 and HTTP/1.1 are served (505 otherwise);
//   - empty lines before the request line are skipped (RFC 9112 §2.2).
// Every refusal carries the status to answer and a message that names what was wrong.
// Thread-safety: value types and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lorasync::http {

struct ParseError {
  int status = 400;     // 400, 413, 431, 501 or 505
  std::string message;  // e.g. "malformed HTTP request: bad header name"
};

struct RequestHead {
  std::string_view method;
  std::string_view target;
  int version_minor = 1;  // HTTP/1.<minor>
  std::vector<std::pair<std::string_view, std::string_view>> fields;  // name, value (OWS trimmed)
  std::size_t head_bytes = 0;  // bytes of the head, final CRLFCRLF included (and skipped empty lines)
  // Framing, derived from the fields.
  bool chunked = false;
  std::optional<std::uint64_t> content_length;
  bool keep_alive = true;
  bool expect_continue = false;
  void clear() {
    method = target = {};
    version_minor = 1;
    fields.clear();
    head_bytes = 0;
    chunked = false;
    content_length.reset();
    keep_alive = true;
    expect_continue = false;
  }
};

enum class ParseStatus { kIncomplete, kDone, kError };

// Parses the head at the start of `buf`. kIncomplete: the head is not all there yet (and `buf` is
// within `max_header_bytes`; past it the answer is kError with 431). `scan_from` lets a caller that
// feeds the same growing buffer skip what an earlier call already searched (pass the previous
// buf.size(); 0 the first time). The views in `out` point into `buf`.
ParseStatus parse_request_head(std::string_view buf, std::size_t max_header_bytes, std::size_t scan_from,
                               RequestHead& out, ParseError& err);

// Decodes a chunked body (RFC 9112 §7.1): chunk extensions are skipped, trailer fields are read
// and dropped. Bounded: the decoded body by `max_body`, each size/extension line by 4 KiB and the
// trailer section by `max_trailer`.
class ChunkedDecoder {
 public:
  ChunkedDecoder(std::uint64_t max_body, std::size_t max_trailer) : max_body_(max_body), max_trailer_(max_trailer) {}
  // Consumes bytes of `in` (returns how many) and appends the decoded data to `body`. Stops at the
  // end of the message (done() true; later bytes belong to the next request) or when `in` ends.
  // kError: the framing is malformed (400) or the body passes the limit (413).
  ParseStatus feed(std::string_view in, std::string& body, std::size_t& consumed, ParseError& err);
  bool done() const { return state_ == State::kDone; }

 private:
  enum class State { kSize, kExt, kSizeLf, kData, kDataCr, kDataLf, kTrailer, kDone };
  State state_ = State::kSize;
  std::uint64_t max_body_;
  std::size_t max_trailer_;
  std::uint64_t chunk_left_ = 0;
  std::uint64_t size_ = 0;
  int size_digits_ = 0;
  std::size_t line_bytes_ = 0;
  std::size_t trailer_bytes_ = 0;
  bool cr_ = false;  // a CR seen in a trailer line or an extension, awaiting its LF
};

}  // namespace lorasync::http
