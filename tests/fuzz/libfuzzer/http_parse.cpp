// libFuzzer: the server's request framing (http/parse.h) on arbitrary bytes. Properties: no crash
// or undefined behaviour (ASan + UBSan); the head parses the same whether it arrives whole or in two
// pieces (with the scan offset a server passes); a refusal names a status the server can answer;
// and a chunked body decodes to the same bytes, end and status whether it is fed whole or in pieces
// of any size.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "http/parse.h"

using lorasync::http::ChunkedDecoder;
using lorasync::http::ParseError;
using lorasync::http::ParseStatus;
using lorasync::http::RequestHead;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::size_t split = data[0];
  const std::size_t piece = 1 + data[1] % 17;
  const std::string_view in(reinterpret_cast<const char*>(data) + 2, size - 2);
  const std::size_t limit = 4096;

  RequestHead whole;
  ParseError err;
  const ParseStatus st = lorasync::http::parse_request_head(in, limit, 0, whole, err);
  if (st == ParseStatus::kError && err.status != 400 && err.status != 431 && err.status != 501 && err.status != 505)
    std::abort();
  if (st == ParseStatus::kError && err.message.empty()) std::abort();
  if (st == ParseStatus::kDone && (whole.head_bytes > in.size() || whole.head_bytes > limit)) std::abort();

  // The same bytes in two pieces: the first call sees a prefix; the second the whole, scanning on.
  if (split < in.size()) {
    RequestHead h;
    ParseError e;
    ParseStatus s1 = lorasync::http::parse_request_head(in.substr(0, split), limit, 0, h, e);
    if (s1 == ParseStatus::kIncomplete) {
      ParseStatus s2 = lorasync::http::parse_request_head(in, limit, split, h, e);
      if (s2 != st) std::abort();
      if (s2 == ParseStatus::kDone && (h.head_bytes != whole.head_bytes || h.method != whole.method ||
                                       h.target != whole.target || h.fields.size() != whole.fields.size()))
        std::abort();
      if (s2 == ParseStatus::kError && e.status != err.status) std::abort();
    } else if (s1 == ParseStatus::kDone) {
      // A complete head in the prefix is the same head.
      if (st != ParseStatus::kDone || h.head_bytes != whole.head_bytes) std::abort();
    }
  }

  // The body after the head (or the whole input) as a chunked body.
  const std::string_view body_in = st == ParseStatus::kDone ? in.substr(whole.head_bytes) : in;
  ChunkedDecoder a(1024, 256);
  std::string body_a;
  std::size_t used_a = 0;
  ParseError ea;
  const ParseStatus sa = a.feed(body_in, body_a, used_a, ea);
  if (used_a > body_in.size() || body_a.size() > 1024) std::abort();
  if (sa == ParseStatus::kError && ea.status != 400 && ea.status != 413 && ea.status != 431) std::abort();

  ChunkedDecoder b(1024, 256);
  std::string body_b;
  std::size_t pos = 0;
  ParseStatus sb = ParseStatus::kIncomplete;
  ParseError eb;
  while (sb == ParseStatus::kIncomplete && pos < body_in.size()) {
    std::size_t used = 0;
    sb = b.feed(body_in.substr(pos, piece), body_b, used, eb);
    pos += used;
  }
  if (sb != sa) std::abort();
  if (sa == ParseStatus::kDone && (pos != used_a || body_b != body_a)) std::abort();
  if (sa == ParseStatus::kIncomplete && body_b != body_a) std::abort();
  if (sa == ParseStatus::kError && eb.status != ea.status) std::abort();
  return 0;
}
