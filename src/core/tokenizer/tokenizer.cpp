// core/tokenizer/tokenizer.cpp: encode / decode pipeline and the incremental decoder.
#include "core/tokenizer/tokenizer.h"

#include <algorithm>
#include <deque>
#include <thread>

#include "core/tokenizer/byte_level.h"
#include "core/tokenizer/tokenizer_impl.h"
#include "core/tokenizer/unicode.h"
#include "util/error.h"

namespace lorasync::tok {

void Tokenizer::Impl::finish() {
  std::int32_t n = model.n_ids();
  for (const AddedToken& t : added) n = std::max(n, t.id + 1);
  id_bytes.assign(static_cast<std::size_t>(n), std::string());
  id_flags.assign(static_cast<std::size_t>(n), 0);
  auto bytes_of = [&](const std::string& tok) -> std::string {
    if (decoder == Decoder::kByteLevel) {
      if (auto raw = byte_level_to_bytes(tok)) return *raw;
    }
    return tok;
  };
  for (std::int32_t id = 0; id < model.n_ids(); ++id) {
    const std::string& tok = model.id_to_token(id);
    if (tok.empty()) continue;
    id_bytes[static_cast<std::size_t>(id)] = bytes_of(tok);
    id_flags[static_cast<std::size_t>(id)] = 1;
  }
  std::unordered_map<std::string, bool> special_content;
  for (const AddedToken& t : added)
    if (t.special) special_content[t.content] = true;
  for (const AddedToken& t : added) {
    id_bytes[static_cast<std::size_t>(t.id)] = bytes_of(t.content);
    id_flags[static_cast<std::size_t>(t.id)] = 1;
    added_by_content.emplace(t.content, t.id);
  }
  // Special-ness is by content, as the reference's is_special_token.
  for (const AddedToken& t : added)
    if (special_content.count(t.content)) id_flags[static_cast<std::size_t>(t.id)] |= 2;
}

std::optional<std::int32_t> Tokenizer::Impl::token_to_id(std::string_view token) const {
  auto it = added_by_content.find(std::string(token));
  if (it != added_by_content.end()) return it->second;
  return model.token_to_id(token);
}

namespace {

struct Scratch {
  std::vector<TextSegment> segs, subsegs;
  std::vector<std::string_view> pieces;
  std::deque<std::string> storage;
};
thread_local Scratch t_scratch;

void model_pieces(const Tokenizer::Impl& im, std::string_view text, std::vector<std::int32_t>& out,
                  Scratch& sc) {
  if (text.empty()) return;
  if (im.pre.empty()) {
    im.model.encode_piece(text, out);
    return;
  }
  im.pre.run(text, sc.pieces, sc.storage);
  for (std::string_view p : sc.pieces) im.model.encode_piece(p, out);
  sc.storage.clear();
}

}  // namespace


void Tokenizer::encode_into(std::string_view text, std::vector<std::int32_t>& out,
                            const EncodeOptions& opts) const {
  const Impl& im = *impl_;
  if (std::size_t bad = validate_utf8(text); bad != std::string_view::npos)
    throw_invalid("text is not valid UTF-8 (invalid byte 0x{:02X} at offset {})",
                  static_cast<unsigned>(static_cast<unsigned char>(text[bad])), bad);
  const bool post_template = opts.add_special_tokens && im.has_template;
  const bool post_config = opts.add_special_tokens && !im.has_template;
  if (post_template) out.insert(out.end(), im.template_prefix.begin(), im.template_prefix.end());
  if (post_config && im.specials.add_bos && im.specials.bos) out.push_back(*im.specials.bos);

  Scratch& sc = t_scratch;
  sc.segs.clear();
  im.raw_matcher.split(text, opts.parse_special, sc.segs);
  std::string normalized;
  for (const TextSegment& seg : sc.segs) {
    if (seg.id >= 0) {
      out.push_back(seg.id);
      continue;
    }
    std::string_view piece = text.substr(seg.begin, seg.end - seg.begin);
    if (piece.empty()) continue;
    if (im.nfc && !nfc_quick_check(piece)) {
      normalized = nfc(piece);
      piece = normalized;
    }
    if (im.norm_matcher.empty()) {
      model_pieces(im, piece, out, sc);
      continue;
    }
    sc.subsegs.clear();
    im.norm_matcher.split(piece, opts.parse_special, sc.subsegs);
    for (const TextSegment& sub : sc.subsegs) {
      if (sub.id >= 0) out.push_back(sub.id);
      else model_pieces(im, piece.substr(sub.begin, sub.end - sub.begin), out, sc);
    }
  }
  if (post_template) out.insert(out.end(), im.template_suffix.begin(), im.template_suffix.end());
  if (post_config && im.specials.add_eos && im.specials.eos) out.push_back(*im.specials.eos);
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& opts) const {
  std::vector<std::int32_t> out;
  out.reserve(text.size() / 3 + 4);
  encode_into(text, out, opts);
  return out;
}

std::vector<std::vector<std::int32_t>> Tokenizer::encode_batch(std::span<const std::string> texts,
                                                               const EncodeOptions& opts,
                                                               int n_threads) const {
  std::vector<std::vector<std::int32_t>> out(texts.size());
  const std::size_t n_workers =
      std::min<std::size_t>(texts.size(), static_cast<std::size_t>(std::max(1, n_threads)));
  if (n_workers <= 1) {
    for (std::size_t i = 0; i < texts.size(); ++i) out[i] = encode(texts[i], opts);
    return out;
  }
  std::vector<std::thread> workers;
  std::vector<std::exception_ptr> errors(n_workers);
  for (std::size_t w = 0; w < n_workers; ++w) {
    workers.emplace_back([&, w] {
      try {
        for (std::size_t i = w; i < texts.size(); i += n_workers) out[i] = encode(texts[i], opts);
      } catch (...) {
        errors[w] = std::current_exception();
      }
    });
  }
  for (auto& t : workers) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

bool Tokenizer::is_valid_id(std::int32_t id) const {
  return id >= 0 && static_cast<std::size_t>(id) < impl_->id_flags.size() &&
         (impl_->id_flags[static_cast<std::size_t>(id)] & 1);
}

bool Tokenizer::is_special(std::int32_t id) const {
  return is_valid_id(id) && (impl_->id_flags[static_cast<std::size_t>(id)] & 2);
}

std::string_view Tokenizer::token_bytes(std::int32_t id) const {
  if (!is_valid_id(id))
    throw_invalid("token id {} is not in the vocabulary (size {})", id, vocab_size());
  return impl_->id_bytes[static_cast<std::size_t>(id)];
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids, bool skip_special) const {
  std::string bytes;
  bytes.reserve(ids.size() * 4);
  bool first = true;
  for (std::int32_t id : ids) {
    std::string_view b = token_bytes(id);
    if (skip_special && is_special(id)) continue;
    if (!decodes_by_concatenation() && !first) bytes.push_back(' ');
    bytes.append(b);
    first = false;
  }
  return utf8_lossy(bytes);
}

std::optional<std::string> Tokenizer::id_to_token(std::int32_t id) const {
  for (const AddedToken& t : impl_->added)
    if (t.id == id) return t.content;
  const std::string& s = impl_->model.id_to_token(id);
  if (s.empty()) return std::nullopt;
  return s;
}

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const {
  return impl_->token_to_id(token);
}

std::int32_t Tokenizer::vocab_size() const {
  return static_cast<std::int32_t>(impl_->id_flags.size());
}
const SpecialTokens& Tokenizer::special_tokens() const { return impl_->specials; }
const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
bool Tokenizer::decodes_by_concatenation() const {
  return impl_->decoder == Impl::Decoder::kByteLevel;
}

// ---- IncrementalDecoder ----

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(tokenizer), skip_special_(skip_special) {}

std::string IncrementalDecoder::push(std::int32_t id) {
  std::string_view b = tokenizer_.token_bytes(id);
  if (skip_special_ && tokenizer_.is_special(id)) return {};
  if (!tokenizer_.decodes_by_concatenation() && !first_) pending_.push_back(' ');
  first_ = false;
  pending_.append(b);
  // Emit everything up to a trailing, still-valid partial character; repair invalid bytes.
  std::string out;
  std::size_t i = 0;
  while (i < pending_.size()) {
    bool valid;
    std::size_t len = utf8_step(pending_, i, valid);
    if (len == 0) break;  // an incomplete character at the end: wait for more bytes
    if (valid) out.append(pending_, i, len);
    else out += "\xEF\xBF\xBD";
    i += len;
  }
  pending_.erase(0, i);
  return out;
}

std::string IncrementalDecoder::flush() {
  std::string out = utf8_lossy(pending_);
  pending_.clear();
  first_ = true;
  return out;
}

}  // namespace lorasync::tok
