// core/tokenizer/tokenizer_load.cpp: tokenizer.json / tokenizer_config.json -> Tokenizer::Impl.
//
// Every error names the file and the JSON path of the offending field ("model.merges[12]"), and
// the value when it is short. Unknown component types are Unsupported, not silently ignored.
#include <nlohmann/json.hpp>

#include "core/tokenizer/tokenizer.h"
#include "core/tokenizer/tokenizer_impl.h"
#include "core/tokenizer/unicode.h"
#include "util/error.h"
#include "util/files.h"

namespace lorasync::tok {

namespace {

using json = nlohmann::json;

constexpr std::int64_t kMaxTokenId = 1 << 24;

class Loader {
 public:
  explicit Loader(std::string origin) : origin_(std::move(origin)) {}

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw Error(ErrorKind::kInvalidInput, fmt::format("{}: {}: {}", origin_, path, what), path);
  }
  [[noreturn]] void unsupported(const std::string& path, const std::string& what) const {
    throw Error(ErrorKind::kUnsupported, fmt::format("{}: {}: {}", origin_, path, what), path);
  }
  static std::string show(const json& j) {
    std::string s = j.dump();
    return s.size() > 60 ? s.substr(0, 57) + "..." : s;
  }
  const json& field(const json& obj, const char* key, const std::string& path) const {
    if (!obj.is_object()) fail(path, "expected an object, got " + show(obj));
    auto it = obj.find(key);
    if (it == obj.end()) fail(join(path, key), "missing");
    return *it;
  }
  static std::string join(const std::string& path, const char* key) {
    return path.empty() ? std::string(key) : path + "." + key;
  }
  std::string str(const json& j, const std::string& path) const {
    if (!j.is_string()) fail(path, "expected a string, got " + show(j));
    return j.get<std::string>();
  }
  bool boolean(const json& obj, const char* key, bool dflt, const std::string& path) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) fail(join(path, key), "expected true or false, got " + show(*it));
    return it->get<bool>();
  }
  std::int32_t id(const json& j, const std::string& path) const {
    if (!j.is_number_integer() && !j.is_number_unsigned())
      fail(path, "expected a token id (integer), got " + show(j));
    auto v = j.get<std::int64_t>();
    // Ids index dense tables: cap them well above any real vocabulary (Qwen: 151,669).
    if (v < 0 || v >= kMaxTokenId)
      fail(path, "token id out of range [0, " + std::to_string(kMaxTokenId) + "): " + std::to_string(v));
    return static_cast<std::int32_t>(v);
  }
  std::string type_of(const json& obj, const std::string& path) const {
    return str(field(obj, "type", path), join(path, "type"));
  }

  void model(const json& m, bool byte_level_input, Tokenizer::Impl& im) const {
    const std::string path = "model";
    if (!m.is_object()) fail(path, "expected an object, got " + show(m));
    if (m.contains("type")) {
      std::string t = type_of(m, path);
      if (t != "BPE") unsupported("model.type", "model type " + show(json(t)) + " (only BPE)");
    }
    if (auto it = m.find("dropout"); it != m.end() && !it->is_null()) {
      if (!it->is_number()) fail("model.dropout", "expected a number or null, got " + show(*it));
      if (it->get<double>() != 0.0) unsupported("model.dropout", "BPE dropout is not supported");
    }
    BpeOptions o;
    o.byte_level_input = byte_level_input;
    if (auto it = m.find("unk_token"); it != m.end() && !it->is_null())
      o.unk_token = str(*it, "model.unk_token");
    if (auto it = m.find("continuing_subword_prefix"); it != m.end() && !it->is_null())
      o.continuing_subword_prefix = str(*it, "model.continuing_subword_prefix");
    if (auto it = m.find("end_of_word_suffix"); it != m.end() && !it->is_null())
      o.end_of_word_suffix = str(*it, "model.end_of_word_suffix");
    o.fuse_unk = boolean(m, "fuse_unk", false, path);
    o.byte_fallback = boolean(m, "byte_fallback", false, path);
    o.ignore_merges = boolean(m, "ignore_merges", false, path);

    const json& v = field(m, "vocab", path);
    if (!v.is_object()) fail("model.vocab", "expected an object {token: id}, got " + show(v));
    std::unordered_map<std::string, std::int32_t> vocab;
    vocab.reserve(v.size());
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string p = "model.vocab[" + show(json(it.key())) + "]";
      if (validate_utf8(it.key()) != std::string_view::npos) fail(p, "token is not valid UTF-8");
      vocab.emplace(it.key(), id(it.value(), p));
    }
    const json& ms = field(m, "merges", path);
    if (!ms.is_array()) fail("model.merges", "expected an array, got " + show(ms));
    std::vector<std::pair<std::string, std::string>> merges;
    merges.reserve(ms.size());
    for (std::size_t i = 0; i < ms.size(); ++i) {
      const json& e = ms[i];
      const std::string p = "model.merges[" + std::to_string(i) + "]";
      if (e.is_string()) {
        const std::string& s = e.get_ref<const std::string&>();
        std::size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail(p, "expected \"left right\" (two tokens, one space), got " + show(e));
        merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
      } else {
        fail(p, "expected \"left right\" or [\"left\", \"right\"], got " + show(e));
      }
    }
    try {
      im.model = BpeModel(std::move(vocab), merges, std::move(o));
    } catch (const Error& err) {
      throw Error(err.kind(), origin_ + ": " + err.what(), err.param());
    }
  }

  // NFC and Sequences of it; returns whether NFC is applied.
  bool normalizer(const json& n, const std::string& path) const {
    if (n.is_null()) return false;
    std::string t = type_of(n, path);
    if (t == "NFC") return true;
    if (t == "Sequence") {
      const json& list = field(n, "normalizers", path);
      if (!list.is_array()) fail(join(path, "normalizers"), "expected an array");
      bool any = false;
      for (std::size_t i = 0; i < list.size(); ++i)
        any |= normalizer(list[i], join(path, "normalizers") + "[" + std::to_string(i) + "]");
      return any;
    }
    unsupported(join(path, "type"), "normalizer " + show(json(t)) + " (supported: NFC, Sequence)");
  }

  static SplitBehavior behavior(const std::string& s, bool& ok) {
    ok = true;
    if (s == "Isolated") return SplitBehavior::kIsolated;
    if (s == "Removed") return SplitBehavior::kRemoved;
    if (s == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
    if (s == "MergedWithNext") return SplitBehavior::kMergedWithNext;
    if (s == "Contiguous") return SplitBehavior::kContiguous;
    ok = false;
    return SplitBehavior::kIsolated;
  }

  void pre_tokenizer(const json& p, const std::string& path, std::vector<PreTokenizerStep>& steps) const {
    if (p.is_null()) return;
    std::string t = type_of(p, path);
    if (t == "Sequence") {
      const json& list = field(p, "pretokenizers", path);
      if (!list.is_array()) fail(join(path, "pretokenizers"), "expected an array");
      for (std::size_t i = 0; i < list.size(); ++i)
        pre_tokenizer(list[i], join(path, "pretokenizers") + "[" + std::to_string(i) + "]", steps);
      return;
    }
    PreTokenizerStep s;
    if (t == "ByteLevel") {
      s.type = PreTokenizerStep::Type::kByteLevel;
      s.add_prefix_space = boolean(p, "add_prefix_space", true, path);
      s.use_regex = boolean(p, "use_regex", true, path);
    } else if (t == "Split" || t == "Digits") {
      for (const auto& prev : steps)
        if (prev.type == PreTokenizerStep::Type::kByteLevel)
          unsupported(path, "a " + t + " after a ByteLevel pre-tokenizer");
      s.type = PreTokenizerStep::Type::kSplit;
      if (t == "Digits") {
        s.pattern = SplitPattern::ascii_digit();
        s.behavior = boolean(p, "individual_digits", false, path) ? SplitBehavior::kIsolated
                                                                  : SplitBehavior::kContiguous;
      } else {
        const json& pat = field(p, "pattern", path);
        const std::string pp = join(path, "pattern");
        if (pat.is_object() && pat.contains("Regex")) {
          try {
            s.pattern = SplitPattern::regex(str(pat["Regex"], pp + ".Regex"));
          } catch (const Error& e) {
            fail(pp + ".Regex", e.what());
          }
        } else if (pat.is_object() && pat.contains("String")) {
          s.pattern = SplitPattern::literal(str(pat["String"], pp + ".String"));
        } else {
          fail(pp, "expected {\"Regex\": ...} or {\"String\": ...}, got " + show(pat));
        }
        std::string b = str(field(p, "behavior", path), join(path, "behavior"));
        bool ok;
        s.behavior = behavior(b, ok);
        if (!ok)
          fail(join(path, "behavior"), "unknown split behavior " + show(json(b)) +
                                           " (Removed, Isolated, MergedWithPrevious, "
                                           "MergedWithNext, Contiguous)");
        s.invert = boolean(p, "invert", false, path);
      }
    } else {
      unsupported(join(path, "type"),
                  "pre-tokenizer " + show(json(t)) + " (supported: Split, ByteLevel, Digits, Sequence)");
    }
    steps.push_back(std::move(s));
  }

  void decoder(const json& d, Tokenizer::Impl& im) const {
    if (d.is_null()) {
      im.decoder = Tokenizer::Impl::Decoder::kNone;
      return;
    }
    std::string t = type_of(d, "decoder");
    if (t != "ByteLevel") unsupported("decoder.type", "decoder " + show(json(t)) + " (only ByteLevel)");
    im.decoder = Tokenizer::Impl::Decoder::kByteLevel;
  }

  void post_processor(const json& p, const std::string& path, Tokenizer::Impl& im) const {
    if (p.is_null()) return;
    std::string t = type_of(p, path);
    if (t == "ByteLevel") return;  // only adjusts offsets
    if (t == "Sequence") {
      const json& list = field(p, "processors", path);
      if (!list.is_array()) fail(join(path, "processors"), "expected an array");
      for (std::size_t i = 0; i < list.size(); ++i)
        post_processor(list[i], join(path, "processors") + "[" + std::to_string(i) + "]", im);
      return;
    }
    if (t != "TemplateProcessing")
      unsupported(join(path, "type"),
                  "post-processor " + show(json(t)) + " (ByteLevel, TemplateProcessing, Sequence)");
    const json& single = field(p, "single", path);
    const json& specials = field(p, "special_tokens", path);
    if (!single.is_array()) fail(join(path, "single"), "expected an array");
    im.has_template = true;
    im.template_prefix.clear();
    im.template_suffix.clear();
    bool seen_a = false;
    for (std::size_t i = 0; i < single.size(); ++i) {
      const std::string pi = join(path, "single") + "[" + std::to_string(i) + "]";
      const json& piece = single[i];
      if (piece.is_object() && piece.contains("Sequence")) {
        seen_a = true;
        continue;
      }
      if (!piece.is_object() || !piece.contains("SpecialToken"))
        fail(pi, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, got " + show(piece));
      std::string name = str(field(piece["SpecialToken"], "id", pi + ".SpecialToken"),
                             pi + ".SpecialToken.id");
      const std::string sp = join(path, "special_tokens") + "." + name;
      if (!specials.is_object() || !specials.contains(name)) fail(sp, "missing");
      const json& ids = field(specials[name], "ids", sp);
      if (!ids.is_array()) fail(sp + ".ids", "expected an array");
      for (std::size_t k = 0; k < ids.size(); ++k) {
        std::int32_t v = id(ids[k], sp + ".ids[" + std::to_string(k) + "]");
        (seen_a ? im.template_suffix : im.template_prefix).push_back(v);
      }
    }
  }

  std::vector<AddedToken> added_tokens(const json& list) const {
    std::vector<AddedToken> out;
    if (list.is_null()) return out;
    if (!list.is_array()) fail("added_tokens", "expected an array, got " + show(list));
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string p = "added_tokens[" + std::to_string(i) + "]";
      const json& e = list[i];
      AddedToken t;
      t.id = id(field(e, "id", p), p + ".id");
      t.content = str(field(e, "content", p), p + ".content");
      if (validate_utf8(t.content) != std::string_view::npos) fail(p + ".content", "not valid UTF-8");
      t.special = boolean(e, "special", false, p);
      t.single_word = boolean(e, "single_word", false, p);
      t.lstrip = boolean(e, "lstrip", false, p);
      t.rstrip = boolean(e, "rstrip", false, p);
      t.normalized = boolean(e, "normalized", !t.special, p);
      out.push_back(std::move(t));
    }
    return out;
  }

  // bos_token etc.: a string, {"content": ...} or null.
  std::optional<std::int32_t> config_token(const json& cfg, const char* key,
                                           const Tokenizer::Impl& im) const {
    auto it = cfg.find(key);
    if (it == cfg.end() || it->is_null()) return std::nullopt;
    std::string content;
    if (it->is_string()) content = it->get<std::string>();
    else if (it->is_object() && it->contains("content")) content = str((*it)["content"], std::string(key) + ".content");
    else fail(key, "expected a string, {\"content\": ...} or null, got " + show(*it));
    auto id = im.token_to_id(content);
    if (!id) fail(key, show(json(content)) + " is not a token of the tokenizer");
    return id;
  }

  const std::string& origin() const { return origin_; }

 private:
  std::string origin_;
};

json parse(std::string_view text, const std::string& origin) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number past double range (found by the tokenizer_json
    // fuzz target: it escaped as a non-lorasync exception).
    throw Error(ErrorKind::kInvalidInput, fmt::format("{}: not valid JSON: {}", origin, e.what()));
  }
}

}  // namespace

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               std::string_view origin) {
  const std::string orig(origin);
  json root = parse(tokenizer_json, orig);
  Loader L(orig);
  if (!root.is_object()) L.fail("(root)", "expected an object");
  auto impl = std::make_shared<Impl>();
  Impl& im = *impl;
  if (root.contains("truncation") && !root["truncation"].is_null())
    L.unsupported("truncation", "truncation settings are not supported (set it to null)");
  if (root.contains("padding") && !root["padding"].is_null())
    L.unsupported("padding", "padding settings are not supported (set it to null)");

  im.nfc = root.contains("normalizer") ? L.normalizer(root["normalizer"], "normalizer") : false;
  std::vector<PreTokenizerStep> steps;
  if (root.contains("pre_tokenizer")) L.pre_tokenizer(root["pre_tokenizer"], "pre_tokenizer", steps);
  // A ByteLevel step that neither adds a space nor splits changes nothing but the byte mapping,
  // which the model does: drop it from the run-time steps.
  bool byte_level = false;
  std::vector<PreTokenizerStep> run_steps;
  for (auto& s : steps) {
    if (s.type == PreTokenizerStep::Type::kByteLevel) {
      byte_level = true;
      if (!s.add_prefix_space && !s.use_regex) continue;
    }
    run_steps.push_back(std::move(s));
  }
  im.pre = PreTokenizer(std::move(run_steps));
  L.model(L.field(root, "model", ""), byte_level, im);
  L.decoder(root.contains("decoder") ? root["decoder"] : json(), im);
  if (root.contains("post_processor")) L.post_processor(root["post_processor"], "post_processor", im);
  im.added = L.added_tokens(root.contains("added_tokens") ? root["added_tokens"] : json());

  std::vector<AddedToken> raw, norm;
  std::vector<std::string> raw_pat, norm_pat;
  for (const AddedToken& t : im.added) {
    if (t.normalized) {
      norm.push_back(t);
      norm_pat.push_back(im.nfc ? nfc(t.content) : t.content);
    } else {
      raw.push_back(t);
      raw_pat.push_back(t.content);
    }
  }
  im.raw_matcher = TokenMatcher(raw, raw_pat);
  im.norm_matcher = TokenMatcher(norm, norm_pat);
  im.finish();

  if (!config_json.empty()) {
    Loader C(orig + " (tokenizer_config.json)");
    json cfg = parse(config_json, C.origin());
    if (!cfg.is_object()) C.fail("(root)", "expected an object");
    im.specials.bos = C.config_token(cfg, "bos_token", im);
    im.specials.eos = C.config_token(cfg, "eos_token", im);
    im.specials.pad = C.config_token(cfg, "pad_token", im);
    im.specials.unk = C.config_token(cfg, "unk_token", im);
    im.specials.add_bos = C.boolean(cfg, "add_bos_token", false, "");
    im.specials.add_eos = C.boolean(cfg, "add_eos_token", false, "");
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(path)) file = path / "tokenizer.json";
  if (!std::filesystem::exists(file))
    throw_not_found("tokenizer file {} does not exist", file.string());
  std::string text = read_file(file);
  std::string config;
  const auto cfg_path = file.parent_path() / "tokenizer_config.json";
  if (std::filesystem::exists(cfg_path)) config = read_file(cfg_path);
  return from_json(text, config, file.string());
}

}  // namespace lorasync::tok
