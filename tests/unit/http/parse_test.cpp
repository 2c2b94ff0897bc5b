// The server's request framing (http/parse.h): what is accepted, what is refused with which status,
// and that feeding the bytes in pieces gives the same result as feeding them at once.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "http/http.h"
#include "http/parse.h"

namespace lorasync::http {
namespace {

using namespace std::string_literals;

struct Parsed {
  ParseStatus status;
  RequestHead head;
  ParseError err;
};

Parsed parse(std::string_view buf, std::size_t limit = 8192) {
  Parsed p;
  p.status = parse_request_head(buf, limit, 0, p.head, p.err);
  return p;
}

int refusal(std::string_view buf, std::size_t limit = 8192) {
  Parsed p = parse(buf, limit);
  EXPECT_EQ(p.status, ParseStatus::kError) << buf;
  return p.status == ParseStatus::kError ? p.err.status : 0;
}

// Header names compare case-insensitively in ASCII only, whatever the process locale: bytes that
// differ by 0x20 outside A-Z (@ and `, [ and {) and Latin-1 letters stay distinct.
TEST(HttpParse, HeaderNamesFoldAsciiCaseOnly) {
  EXPECT_TRUE(iequals("Content-Length", "content-LENGTH"));
  EXPECT_TRUE(iequals("", ""));
  EXPECT_TRUE(iequals("x-Request-ID", "X-REQUEST-id"));
  EXPECT_FALSE(iequals("content-length", "content-lengths"));
  EXPECT_FALSE(iequals("@", "`"));
  EXPECT_FALSE(iequals("[", "{"));
  EXPECT_FALSE(iequals("\xC9", "\xE9"));
  EXPECT_TRUE(iequals("\xC9" "a", "\xC9" "A"));
  for (int c = 0; c < 256; ++c)
    for (int d = 0; d < 256; ++d) {
      const char a = static_cast<char>(c), b = static_cast<char>(d);
      const bool folded = c == d || (c >= 'A' && c <= 'Z' && d == c + 32) || (d >= 'A' && d <= 'Z' && c == d + 32);
      ASSERT_EQ(iequals(std::string_view(&a, 1), std::string_view(&b, 1)), folded) << c << " " << d;
    }
}

TEST(HttpParse, ARequestHeadWithItsFraming) {
  const std::string req =
      "POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Type:  application/json \r\n"
      "Content-Length: 12\r\nX-Empty:\r\n\r\n{\"prompt\":1}";
  Parsed p = parse(req);
  ASSERT_EQ(p.status, ParseStatus::kDone) << p.err.message;
  EXPECT_EQ(p.head.method, "POST");
  EXPECT_EQ(p.head.target, "/v1/completions?x=1");
  EXPECT_EQ(p.head.version_minor, 1);
  ASSERT_EQ(p.head.fields.size(), 4u);
  EXPECT_EQ(p.head.fields[1].first, "Content-Type");
  EXPECT_EQ(p.head.fields[1].second, "application/json");  // OWS trimmed
  EXPECT_EQ(p.head.fields[3].second, "");
  EXPECT_EQ(p.head.content_length, 12u);
  EXPECT_FALSE(p.head.chunked);
  EXPECT_TRUE(p.head.keep_alive);
  EXPECT_EQ(p.head.head_bytes, req.find("{"));
}

TEST(HttpParse, KeepAliveFollowsTheVersionAndConnection) {
  EXPECT_FALSE(parse("GET / HTTP/1.1\r\nConnection: Close\r\n\r\n").head.keep_alive);
  EXPECT_FALSE(parse("GET / HTTP/1.0\r\n\r\n").head.keep_alive);
  EXPECT_TRUE(parse("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n").head.keep_alive);
  EXPECT_FALSE(parse("GET / HTTP/1.1\r\nConnection: keep-alive, close\r\n\r\n").head.keep_alive);
  EXPECT_TRUE(parse("GET / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n").head.expect_continue);
}

TEST(HttpParse, IncompleteUntilTheBlankLineAnd431Past) {
  EXPECT_EQ(parse("GET / HTTP/1.1\r\nHost: a\r\n").status, ParseStatus::kIncomplete);
  EXPECT_EQ(parse("").status, ParseStatus::kIncomplete);
  EXPECT_EQ(parse("\r\n\r\n").status, ParseStatus::kIncomplete);  // empty lines before a request
  EXPECT_EQ(parse("\r\nGET / HTTP/1.1\r\n\r\n").status, ParseStatus::kDone);
  const std::string big = "GET / HTTP/1.1\r\nX: " + std::string(200, 'a') + "\r\n";
  EXPECT_EQ(refusal(big, 100), 431);                 // not finished and already past the limit
  EXPECT_EQ(refusal(big + "\r\n", 100), 431);        // finished but past the limit
  EXPECT_EQ(parse(big + "\r\n", big.size() + 2).status, ParseStatus::kDone);
}

TEST(HttpParse, RefusesWhatCouldDesyncAProxy) {
  const std::string get = "GET / HTTP/1.1\r\n";
  const std::pair<std::string, int> cases[] = {
      {get + "Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {get + "Content-Length: 1\r\nContent-Length: 2\r\n\r\n", 400},
      {get + "Content-Length: +1\r\n\r\n", 400},
      {get + "Content-Length: 0x10\r\n\r\n", 400},
      {get + "Content-Length: 99999999999999999999\r\n\r\n", 400},
      {get + "Content-Length:\r\n\r\n", 400},
      {get + "Transfer-Encoding: gzip, chunked\r\n\r\n", 501},
      {get + "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {"GET / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {get + "Host : a\r\n\r\n", 400},       // space before the colon
      {get + "X: a\r\n b\r\n\r\n", 400},      // obsolete folding
      {get + "X: a\nY: b\r\n\r\n", 400},      // bare LF
      {get + "X: a\rY: b\r\n\r\n", 400},      // bare CR
      {get + "X: a\0b\r\n\r\n"s, 400},        // NUL
      {get + ": a\r\n\r\n", 400},
      {"GET  / HTTP/1.1\r\n\r\n", 400},
      {"GET /a b HTTP/1.1\r\n\r\n", 400},
      {"GET / HTTP/1.1 \r\n\r\n", 400},
      {"G(T / HTTP/1.1\r\n\r\n", 400},
      {"GET / HTTP/2.0\r\n\r\n", 505},
      {"GET / HTTP/1.2\r\n\r\n", 505},
      {"GET / HTTPS/1.1\r\n\r\n", 400},
  };
  for (const auto& [input, status] : cases) EXPECT_EQ(refusal(input), status) << input;
  EXPECT_EQ(parse(get + "Content-Length: 2, 2\r\n\r\n").head.content_length, 2u);
  Parsed p = parse(get + "Content-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n");
  EXPECT_NE(p.err.message.find("both Content-Length and Transfer-Encoding"), std::string::npos) << p.err.message;
}

TEST(HttpParse, TheHeadParsesTheSameWhenItArrivesByteByByte) {
  const std::string req = "\r\nPUT /x HTTP/1.1\r\nA: 1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n";
  Parsed whole = parse(req);
  ASSERT_EQ(whole.status, ParseStatus::kDone);
  RequestHead head;
  ParseError err;
  std::size_t scanned = 0;
  for (std::size_t n = 0; n <= req.size(); ++n) {
    const ParseStatus st = parse_request_head(std::string_view(req).substr(0, n), 8192, scanned, head, err);
    if (st == ParseStatus::kDone) {
      EXPECT_EQ(n, whole.head.head_bytes);
      break;
    }
    ASSERT_EQ(st, ParseStatus::kIncomplete) << n;
    scanned = n;
  }
  EXPECT_EQ(head.method, "PUT");
  EXPECT_TRUE(head.chunked);
  EXPECT_EQ(head.head_bytes, whole.head.head_bytes);
}

std::string decode_all(std::string_view in, std::size_t& used, ParseStatus& st, ParseError& err,
                       std::uint64_t limit = 1 << 20) {
  ChunkedDecoder d(limit, 1024);
  std::string body;
  st = d.feed(in, body, used, err);
  return body;
}

TEST(HttpParse, ChunkedBodiesWithExtensionsAndTrailers) {
  const std::string in = "5;name=value\r\nhello\r\n1A\r\n" + std::string(26, 'x') + "\r\n0\r\nTrailer: t\r\n\r\nNEXT";
  std::size_t used = 0;
  ParseStatus st;
  ParseError err;
  std::string body = decode_all(in, used, st, err);
  ASSERT_EQ(st, ParseStatus::kDone) << err.message;
  EXPECT_EQ(body, "hello" + std::string(26, 'x'));
  EXPECT_EQ(in.substr(used), "NEXT");  // the next request is left alone

  // Split at every point: the same body and the same end.
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    ChunkedDecoder d(1 << 20, 1024);
    std::string b;
    std::size_t pos = 0;
    ParseStatus s = ParseStatus::kIncomplete;
    while (s == ParseStatus::kIncomplete && pos < in.size()) {
      const std::size_t n = 1 + rng() % 7;
      std::size_t u = 0;
      s = d.feed(std::string_view(in).substr(pos, n), b, u, err);
      pos += u;
    }
    ASSERT_EQ(s, ParseStatus::kDone);
    EXPECT_EQ(b, body);
    EXPECT_EQ(pos, used);
  }
}

TEST(HttpParse, ChunkedRefusals) {
  std::size_t used = 0;
  ParseStatus st;
  ParseError err;
  for (std::string bad : {"g\r\n", "\r\n", "5\r\nhelloX\r\n", "5\nhello\r\n", "1234567890abcdef0\r\n", "5;a\nb\r\n",
                          "0\r\nT: a\rb\r\n\r\n", "-1\r\n"}) {
    decode_all(bad, used, st, err);
    EXPECT_EQ(st, ParseStatus::kError) << bad;
    EXPECT_EQ(err.status, 400) << bad;
    EXPECT_NE(err.message.find("bad chunked body"), std::string::npos) << err.message;
  }
  decode_all("10\r\n0123456789abcdef\r\n0\r\n\r\n", used, st, err, 15);
  EXPECT_EQ(st, ParseStatus::kError);
  EXPECT_EQ(err.status, 413);
  decode_all("0\r\nT: " + std::string(2000, 'a') + "\r\n\r\n", used, st, err);
  EXPECT_EQ(st, ParseStatus::kError);
  EXPECT_EQ(err.status, 431);
}

}  // namespace
}  // namespace lorasync::http
