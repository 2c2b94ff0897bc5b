#include "bench/proxy/completion_body.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <nlohmann/json.hpp>

#include "util/random.h"

namespace lorasync::bench {

namespace {

struct TableToken {
  std::int32_t id;
  const char* text;
};

// Every 69th token of the ASCII problems of MATH-500 (/work/shared/data/eval_math500.jsonl) under
// the Qwen2 tokenizer, each decoded alone.
constexpr TableToken kTokens[] = {
    {12012, "Convert"}, {61, "^"}, {15170, "}{"}, {4361, " whole"}, {600, " i"}, {1502, "label"}, {19, "4"},
    {13, "."}, {468, " E"}, {4930, " $("}, {11, ","}, {1091, " than"}, {279, " the"}, {264, " a"}, {18, "3"},
    {9961, " cm"}, {13, "."}, {18, "3"}, {317, ");\n"}, {89, "z"}, {551, "ize"}, {467, " W"}, {264, " a"},
    {8, ")"}, {16, "1"}, {4897, "BC"}, {17, "2"}, {11, ","}, {12196, " greatest"}, {2813, " company"},
    {311, " to"}, {2692, " account"}, {11, ","}, {1741, " such"}, {1852, " same"}, {3, "$"}, {1033, " were"},
    {22, "7"}, {315, " of"}, {30529, "-\\"}, {320, " ("}, {59, "\\"}, {220, " "}, {19, "4"}, {87, "x"},
    {279, " the"}, {14587, " mile"}, {24884, "^\\"}, {315, " of"}, {279, " the"}, {8063, " eight"},
    {17779, " divided"}, {18, "3"}, {3, "$"}, {78, "o"}, {785, "The"}, {488, " +"}, {90, "{"}, {10374, "math"},
    {11, ","}, {87, "x"}, {16, "1"}, {3082, " area"}, {10061, "Let"}, {17399, " Express"}, {785, "The"},
    {1352, " form"}, {7947, " domain"}, {61, "^"}, {50853, "cdot"}, {68, "e"}, {2878, " within"}, {284, " ="},
    {23092, " bases"}, {23, "8"}, {335, " }"}, {49109, " divisor"}, {284, " ="}, {6896, " exactly"},
    {525, " are"}, {320, " ("}, {17, "2"}, {220, " "}, {88, "y"}, {481, " -"}, {315, " of"}, {90, "{"},
    {9710, " west"}, {429, " that"}, {12670, "pair"}, {46, "O"}, {1502, "label"}, {51185, "}="}, {1975, "over"},
    {41715, "+\\"}, {1077, " let"}, {69, "f"}, {15, "0"}, {66, "c"}, {19, "4"}, {17, "2"}, {16, "1"},
    {897, " value"}, {279, " the"}, {400, " $"}, {24884, "^\\"}, {9407, "cos"}, {400, " $"}, {16, "1"},
    {90, "{"}, {374, " is"}, {90, "{"}, {21, "6"}, {488, " +"}, {279, " the"}, {400, " $"}, {284, " ="},
    {14085, "$$"}, {15, "0"}, {7, "("}, {317, ");\n"}, {400, " $"}, {1089, "_n"}, {374, " is"},
    {7546, " integer"}, {69, "f"}, {279, " the"}, {17, "2"}, {2418, ".$"}, {3, "$"}, {1124, " \\"},
    {279, " the"}, {7192, " maximum"}, {220, " "}, {916, " over"}, {4779, ",$"}, {46, "O"}, {16, "1"}, {3, "$"},
    {2679, "If"}, {2593, "mod"}, {52847, " recursively"}, {709, "ge"}, {16, "1"}, {17, "2"}, {92, "}"},
    {1555, " line"}, {16574, "-point"}, {24157, "[/"}, {35702, "{\\"}, {30, "?"}, {323, " and"}, {10106, " AP"},
    {7633, "draw"}, {279, " the"}, {304, " in"}, {26618, " randomly"}, {220, " "}, {32, "A"}, {4226, " answer"},
    {72, "i"}, {3741, "dir"}, {24157, "[/"}, {3555, " What"}, {17808, "bp"}, {1188, "(("}, {11453, "black"},
    {20, "5"}, {17, "2"}, {19, "4"}, {7, "("}, {15, "0"}, {1188, "(("}, {21495, " triangle"}, {37018, "frac"},
    {52484, " geometric"}, {400, " $"}, {50853, "cdot"}, {393, " P"}, {7633, "draw"}, {317, ");\n"}, {220, " "},
    {400, " $"}, {264, " a"}, {16, "1"}, {2613, " small"}, {74, "k"}, {22, "7"}, {18, "3"}, {18, "3"},
    {6422, " floor"}, {315, " of"}, {3040, " four"}, {280, ";\n"}, {57, "Z"}, {317, ");\n"}, {315, " of"},
    {429, " that"}, {374, " is"}, {488, " +"}, {400, " $"}, {87, "x"}, {1657, " many"}, {220, " "},
    {5203, " groups"}, {2484, " turn"}, {90, "{"}, {488, " +"}, {24984, " \\\\"}, {1124, " \\"}, {408, "end"},
    {8402, ",b"}, {374, " is"}, {322, "//"}, {73, "j"}, {18, "3"}, {3501, " points"}, {90, "{"}, {16, "1"},
    {61, "^"}, {1415, "ets"}, {374, " is"}, {374, " is"}, {6226, "cm"}, {17, "2"}, {15, "0"}, {11650, "gray"},
    {29621, ")--"}, {7, "("}, {701, "),"}, {317, ");\n"}, {20, "5"}, {315, " of"}, {1975, "over"},
    {20912, "(\"$"}, {15170, "}{"}, {15, "0"}, {6783, " constant"}, {16, "1"}, {198, "\n"}, {20969, " meals"},
    {198, "\n"}, {323, " and"}, {57960, " $\\"}, {31716, "}$"}, {3391, "then"}, {2075, "(x"}, {488, " +"},
    {54876, "$,"}, {400, " $"}, {400, " $"}, {7, "("}, {20, "5"}, {11, ","}, {12, "-"}, {4236, " five"},
    {65930, " convex"}, {10, "+"}, {11, ","}, {90, "{"}, {92, "}"}, {1484, "cept"}, {825, " one"}, {525, " are"},
    {8482, " containing"}, {220, " "}, {12947, "$."}, {18, "3"}, {323, " and"}, {220, " "}, {220, " "},
    {18, "3"}, {12427, "extension"}, {1502, "label"}, {3555, " What"}, {317, ");\n"}, {5265, "];"}, {220, " "},
    {15, "0"}, {15, "0"}, {3, "$"}, {15, "0"}, {3, "$"}, {31716, "}$"}, {13604, " regions"}, {17545, " gray"},
    {323, " and"}, {9210, " angle"}, {23, "8"}, {17, "2"}, {23, "8"}, {15, "0"}, {13, "."}, {279, " the"},
    {311, " to"}, {6693, " whose"}, {11, ","}, {3204, " possible"}, {61, "^"}, {3966, "One"}, {18, "3"},
    {7379, " Find"}, {61, "^"}, {51424, " rectangular"}, {12, "-"}, {400, " $"}, {279, " the"}, {315, " of"},
    {525, " are"}, {59, "\\"}, {3, "$"}, {7046, " greater"}, {481, " -"}, {2555, "atrix"}, {400, " $"},
    {806, " his"}, {921, "]\n"}, {1106, "));\n"}, {1, "\""}, {20, "5"}, {4806, ")*"}, {13, "."}, {1502, "label"},
    {4806, ")*"}, {19, "4"}, {15, "0"}, {49212, " stamps"}, {3, "$"}, {11035, "}\\"}, {1958, "for"},
    {374, " is"}, {291, "ed"}, {5666, " operation"}, {31716, "}$"}, {374, " is"}, {26165, "icycle"}, {13, "."},
    {400, " $"}, {37018, "frac"}, {3175, " single"}, {12670, "pair"}, {73315, "$\","}, {50802, " hallway"},
    {3555, " What"}, {315, " of"}, {284, " ="}, {7, "("}, {468, " E"}, {258, "in"}, {481, " -"}, {1291, "right"},
    {13302, " expressed"}, {15, "0"}, {488, " +"}, {2679, "If"}, {3555, " What"}, {374, " is"},
    {23606, " equation"}, {323, " and"}, {86198, " reciprocal"}, {8, ")"}, {2371, "-g"}, {20, "5"},
    {1251, " people"}, {314, " {"}, {28, "="}, {386, " M"}, {32, "A"}, {400, " $"}, {64, "a"}, {20, "5"},
    {264, " a"}, {14581, " &="}, {488, " +"}, {72, "i"}, {23, "8"}, {87, "x"}, {315, " of"}, {264, " a"},
    {220, " "}, {1052, " there"}, {11730, ")="}, {369, " for"}, {13, "."}, {524, "ang"}, {2418, ".$"},
    {400, " $"}, {1188, "(("}, {20, "5"}, {3, "$"}, {90, "{"}, {315, " of"}, {15087, ")$"}, {0, "!"},
    {27485, " females"}, {91550, "mathrm"}, {90, "{"}, {198, "\n"}, {323, " and"}, {551, "ize"}, {18, "3"},
    {15, "0"}, {315, " of"}, {400, " $"}, {31716, "}$"}, {3433, "lem"}, {59, "\\"}, {1124, " \\"}, {15, "0"},
    {17, "2"}, {15, "0"}, {626, ");\n\n"}, {1502, "label"}, {11, ","}, {5619, " playing"}, {2679, "If"},
    {374, " is"}, {11, ","}, {15, "0"}, {279, " the"}, {28235, " Ian"}, {16, "1"}, {279, " the"}, {481, " -"},
    {19, "4"}, {12607, " assigned"}, {32, "A"}, {264, " a"}, {400, " $"}, {4780, " friends"}, {87, "x"},
    {279, " the"}, {24884, "^\\"}, {3, "$"}, {408, "end"}, {65, "b"}, {400, " $"}, {488, " +"}, {17, "2"},
    {20, "5"}, {87, "x"}, {64, "a"}, {44548, " simplest"}, {3741, "dir"}, {46118, " pencil"}, {21, "6"},
    {29776, ")^"}, {284, " ="}, {810, "use"}, {6896, " exactly"}, {7265, "begin"}, {279, " the"}, {15, "0"},
    {374, " is"}, {311, " to"}, {15, "0"}, {400, " $"}, {1732, "par"}, {19, "4"}, {7633, "draw"}, {31716, "}$"},
    {2593, "mod"}, {20, "5"}, {429, " that"}, {374, " is"}, {11972, " grade"}, {24984, " \\\\"}, {1246, " how"},
    {19, "4"}, {13, "."}, {7329, " surface"}, {46103, "parallel"}, {16, "1"}, {1502, "label"}, {408, "end"},
    {1417, " Sh"}, {18762, " coins"}, {400, " $"}, {488, " +"}, {15, "0"}, {317, ");\n"}, {7, "("}, {400, " $"},
    {23, "8"}, {38214, "Below"}, {1188, "(("}, {10, "+"}, {13, "."}, {90, "{"}, {3, "$"}, {16246, " Given"},
    {13, "."}, {2629, " sum"}, {220, " "}, {678, " all"}, {19, "4"}, {15170, "}{"}, {311, " to"}, {220, " "},
    {356, " C"}, {73315, "$\","}, {6405, "asy"}, {488, " +"}, {11730, ")="}, {284, " ="}, {279, " the"},
    {6716, " pair"}, {825, " one"}, {5187, "pm"}, {31716, "}$"}, {488, " +"}, {89936, " logarith"},
};
constexpr std::size_t kNTokens = sizeof kTokens / sizeof kTokens[0];
constexpr std::size_t kNLogprobs = 509;  // prime, so that a token's logprob changes from lap to lap

// JSON string contents as nlohmann's dump writes them (ensure_ascii off: only '"', '\\' and
// control characters escaped).
void escape_into(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 15];
        } else {
          out += ch;
        }
    }
  }
}

// The table's pieces rendered once: escaped texts, ids, and the logprobs as nlohmann formats a
// float widened to double (what CompletionState stores).
struct Rendered {
  std::array<std::string, kNTokens> text, id;
  std::array<float, kNLogprobs> lp;
  std::array<std::string, kNLogprobs> lp_text;
  Rendered() {
    for (std::size_t i = 0; i < kNTokens; ++i) {
      escape_into(text[i], kTokens[i].text);
      id[i] = std::to_string(kTokens[i].id);
    }
    for (std::size_t i = 0; i < kNLogprobs; ++i) {
      // A sampled token's log-probability: log u, u uniform in (0, 1] (mean -1).
      const double u = 1.0 - unit_interval(splitmix64(0x5eedull + i));
      lp[i] = static_cast<float>(std::log(std::max(u, 1e-12)));
      lp_text[i] = nlohmann::json(static_cast<double>(lp[i])).dump();
    }
  }
};
const Rendered& rendered() {
  static const Rendered r;
  return r;
}

struct Pos {
  std::size_t token, lp;
};
Pos position(std::uint64_t seed, std::size_t choice, std::size_t k) {
  const std::uint64_t h = splitmix64(seed * kSplitMixGamma ^ (choice + 1) * 0x9e3779b97f4a7c15ull);
  return {static_cast<std::size_t>((h + k) % kNTokens), static_cast<std::size_t>(((h >> 32) + 7 * k) % kNLogprobs)};
}

void append_int(std::string& out, std::int64_t v) {
  char b[24];
  out.append(b, static_cast<std::size_t>(std::to_chars(b, b + sizeof b, v).ptr - b));
}

// The value after a top-level-looking `"key":` (first occurrence), spaces skipped; empty if absent.
std::string_view value_of(std::string_view body, std::string_view quoted_key) {
  std::size_t p = body.find(quoted_key);
  if (p == std::string_view::npos) return {};
  p += quoted_key.size();
  while (p < body.size() && (body[p] == ' ' || body[p] == ':' || body[p] == '\n' || body[p] == '\t')) ++p;
  return body.substr(p);
}

bool int_of(std::string_view v, int& out) {
  int x = 0;
  auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  if (r.ec != std::errc()) return false;
  out = x;
  return true;
}

}  // namespace

GenToken generated_token(std::uint64_t seed, std::size_t choice, std::size_t k) {
  const Pos p = position(seed, choice, k);
  return {kTokens[p.token].id, kTokens[p.token].text, rendered().lp[p.lp]};
}

std::string generation_table_json() {
  nlohmann::json t = nlohmann::json::array(), l = nlohmann::json::array();
  for (const auto& k : kTokens) t.push_back({k.id, k.text});
  for (float x : rendered().lp) l.push_back(static_cast<double>(x));
  return nlohmann::json{{"tokens", t}, {"logprobs", l}}.dump();
}

CompletionAsk read_completion_ask(std::string_view body) {
  CompletionAsk a;
  int v = 0;
  if (int_of(value_of(body, "\"max_tokens\""), v) && v > 0) a.max_tokens = v;
  if (int_of(value_of(body, "\"n\""), v) && v > 0) a.n = v;
  a.logprobs = int_of(value_of(body, "\"logprobs\""), v);
  a.return_token_ids = value_of(body, "\"return_token_ids\"").starts_with("true");
  std::string_view p = value_of(body, "\"prompt\"");
  if (p.starts_with('[')) {
    std::size_t i = 1;
    for (;;) {
      while (i < p.size() && (p[i] == ' ' || p[i] == ',' || p[i] == '\n')) ++i;
      if (i >= p.size() || p[i] == ']') break;
      std::int64_t id = 0;
      auto r = std::from_chars(p.data() + i, p.data() + p.size(), id);
      if (r.ec != std::errc()) {  // not a flat list of ids: a text or nested prompt
        a.prompt_ids.clear();
        break;
      }
      a.prompt_ids.push_back(id);
      i = static_cast<std::size_t>(r.ptr - p.data());
    }
  }
  return a;
}

std::string completion_body(const CompletionAsk& ask, const CompletionMeta& meta, std::uint64_t seed) {
  const Rendered& R = rendered();
  const auto n = static_cast<std::size_t>(std::max(1, ask.n));
  const auto T = static_cast<std::size_t>(std::max(0, ask.max_tokens));
  std::string out;
  out.reserve(256 + n * (T * 40 + ask.prompt_ids.size() * 7 + 128));
  out += "{\"choices\":[";
  std::vector<Pos> pos(T);
  for (std::size_t c = 0; c < n; ++c) {
    for (std::size_t k = 0; k < T; ++k) pos[k] = position(seed, c, k);
    if (c) out += ',';
    out += "{\"finish_reason\":\"length\",\"index\":";
    append_int(out, static_cast<std::int64_t>(c));
    out += ",\"logprobs\":";
    if (ask.logprobs) {
      out += "{\"text_offset\":[";
      std::int64_t off = 0;
      for (std::size_t k = 0; k < T; ++k) {
        if (k) out += ',';
        append_int(out, off);
        off += static_cast<std::int64_t>(std::char_traits<char>::length(kTokens[pos[k].token].text));
      }
      out += "],\"token_logprobs\":[";
      for (std::size_t k = 0; k < T; ++k) {
        if (k) out += ',';
        out += R.lp_text[pos[k].lp];
      }
      out += "],\"tokens\":[";
      for (std::size_t k = 0; k < T; ++k) {
        if (k) out += ',';
        out += '"';
        out += R.text[pos[k].token];
        out += '"';
      }
      out += "],\"top_logprobs\":null}";
    } else {
      out += "null";
    }
    if (ask.return_token_ids) {
      out += ",\"prompt_token_ids\":[";
      for (std::size_t i = 0; i < ask.prompt_ids.size(); ++i) {
        if (i) out += ',';
        append_int(out, ask.prompt_ids[i]);
      }
      out += ']';
    }
    out += ",\"text\":\"";
    for (std::size_t k = 0; k < T; ++k) out += R.text[pos[k].token];
    out += '"';
    if (ask.return_token_ids) {
      out += ",\"token_ids\":[";
      for (std::size_t k = 0; k < T; ++k) {
        if (k) out += ',';
        out += R.id[pos[k].token];
      }
      out += ']';
    }
    out += '}';
  }
  out += "],\"created\":";
  append_int(out, meta.created);
  out += ",\"id\":\"";
  escape_into(out, meta.id);
  out += "\",\"lorasync\":{\"adapter\":";
  auto str_or_null = [&](const std::string& s) {
    if (s.empty()) {
      out += "null";
    } else {
      out += '"';
      escape_into(out, s);
      out += '"';
    }
  };
  str_or_null(meta.adapter);
  out += ",\"adapter_sha256\":";
  str_or_null(meta.adapter.empty() ? std::string() : meta.adapter_sha256);
  out += ",\"base_model_sha256\":\"";
  escape_into(out, meta.base_model_sha256);
  out += "\"},\"model\":\"";
  escape_into(out, ask.model);
  const auto completion = static_cast<std::int64_t>(n * T);
  const auto prompt = static_cast<std::int64_t>(meta.prompt_tokens), cached = static_cast<std::int64_t>(meta.cached_prompt_tokens);
  out += "\",\"object\":\"text_completion\",\"usage\":{\"cached_prompt_tokens\":";
  append_int(out, cached);
  out += ",\"completion_tokens\":";
  append_int(out, completion);
  out += ",\"prompt_tokens\":";
  append_int(out, prompt);
  out += ",\"prompt_tokens_details\":{\"cached_tokens\":";
  append_int(out, cached);
  out += "},\"total_tokens\":";
  append_int(out, prompt + completion);
  out += "}}";
  return out;
}

}  // namespace lorasync::bench
