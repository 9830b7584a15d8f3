#include "prep/prepared_data.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/data/token_data.h"
#include "io/safe_write.h"

namespace strata {

int64_t TokenStream::targets() const {
  return std::accumulate(mask.begin(), mask.end(), int64_t(0));
}

void append_marked_text(Tokenizer& tokenizer, const std::vector<MarkedText>& pieces,
                        TokenStream& out) {
  // The whole text and, for each piece, where it ends in it and whether it is a target.
  std::string text;
  std::vector<uint64_t> piece_end;
  std::vector<bool> piece_target;
  for (const MarkedText& piece : pieces) {
    if (piece.text.empty()) continue;
    text += piece.text;
    piece_end.push_back(text.size());
    piece_target.push_back(piece.target);
  }
  std::vector<TokenSpan> spans;
  tokenizer.encode_spans(text, false, spans);
  // Spans and pieces are both in text order: walk them together.
  size_t piece = 0;
  for (const TokenSpan& span : spans) {
    while (piece < piece_end.size() && piece_end[piece] <= span.begin) ++piece;
    bool target = false;
    for (size_t p = piece; p < piece_end.size(); ++p) {
      target = target || piece_target[p];
      if (piece_end[p] >= span.end) break;
    }
    out.tokens.push_back(span.id);
    out.mask.push_back(target ? 1 : 0);
  }
}

int token_width(int64_t vocab_size) {
  return vocab_size <= int64_t(std::numeric_limits<uint16_t>::max()) + 1 ? 2 : 4;
}

namespace {

std::string shard_bytes(const TokenStream& stream, int width) {
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = width == 2 ? kLlmcMagicUint16 : kLlmcMagicUint32;
  header[1] = width == 2 ? 1 : 7;
  header[2] = int32_t(stream.tokens.size());
  std::string bytes(sizeof(header) + stream.tokens.size() * size_t(width), '\0');
  std::memcpy(bytes.data(), header, sizeof(header));
  char* out = bytes.data() + sizeof(header);
  for (size_t i = 0; i < stream.tokens.size(); ++i) {
    if (width == 2) {
      const uint16_t token = uint16_t(stream.tokens[i]);
      std::memcpy(out + 2 * i, &token, 2);
    } else {
      std::memcpy(out + 4 * i, &stream.tokens[i], 4);
    }
  }
  return bytes;
}

}  // namespace

Status write_token_outputs(const std::vector<TokenOutput>& outputs, int width) {
  std::vector<io::AtomicFileWriter> writers;
  auto write = [&](const std::string& path, const void* data, size_t size) -> Status {
    Result<io::AtomicFileWriter> writer = io::AtomicFileWriter::create(path);
    if (!writer) return writer.status();
    if (Status s = writer->append(data, size); !s) return s;
    writers.push_back(std::move(*writer));
    return Status::ok();
  };
  for (const TokenOutput& output : outputs) {
    const TokenStream& stream = *output.stream;
    if (stream.tokens.size() < 2)
      return Status::error(
          fmt::format("{}: {} token(s); a token file needs at least 2 (more input, or a different "
                      "--val-fraction)",
                      output.path, stream.tokens.size()));
    if (stream.tokens.size() > size_t(std::numeric_limits<int32_t>::max()))
      return Status::error(
          fmt::format("{}: {} tokens exceed the 2^31-1 an llm.c shard counts; split the input",
                      output.path, stream.tokens.size()));
    if (stream.mask.size() != stream.tokens.size())
      return Status::error(fmt::format("{}: the mask has {} bytes for {} tokens", output.path,
                                       stream.mask.size(), stream.tokens.size()));
    const std::string bytes = shard_bytes(stream, width);
    if (Status s = write(output.path, bytes.data(), bytes.size()); !s) return s;
    if (Status s = write(loss_mask_path(output.path), stream.mask.data(), stream.mask.size()); !s)
      return s;
  }
  for (io::AtomicFileWriter& writer : writers)
    if (Status s = writer.commit(); !s) return s;
  return Status::ok();
}

}  // namespace strata
