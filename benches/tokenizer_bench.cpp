// The byte-level BPE tokenizer (prep/tokenizer.h) on a JSONL of documents,
// one thread, in bytes and tokens per second; benches/tokenizer_compare.py runs
// it next to Hugging Face `tokenizers`.
//
//   tokenizer_bench --tokenizer=DIR/tokenizer.json --documents=FILE.jsonl [benchmark flags]
//
// Each iteration encodes every document ({"text": ...} per line) with
// encode(text, add_special_tokens=false) on one Tokenizer, so its word cache
// is warm after the first pass, as that of a `tokenizers` object is. Counters:
// bytes_per_second, tokens_per_second (of the last pass), documents, tokens.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "prep/tokenizer.h"

namespace {

std::string g_tokenizer_path;
std::string g_documents_path;

void EncodeDocuments(benchmark::State& state) {
  strata::Result<strata::Tokenizer> tokenizer = strata::Tokenizer::load(g_tokenizer_path);
  if (!tokenizer) {
    state.SkipWithError(tokenizer.status().message().c_str());
    return;
  }
  std::vector<std::string> documents;
  std::ifstream in(g_documents_path);
  if (!in) {
    state.SkipWithError(("cannot open --documents=" + g_documents_path).c_str());
    return;
  }
  int64_t bytes = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    documents.push_back(nlohmann::json::parse(line).at("text").get<std::string>());
    bytes += int64_t(documents.back().size());
  }
  int64_t tokens = 0;
  for (auto _ : state) {
    tokens = 0;
    for (const std::string& document : documents) {
      std::vector<uint32_t> ids = tokenizer->encode(document, false);
      tokens += int64_t(ids.size());
      benchmark::DoNotOptimize(ids.data());
    }
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["tokens_per_second"] =
      benchmark::Counter(double(tokens) * double(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["documents"] = double(documents.size());
  state.counters["tokens"] = double(tokens);
}
BENCHMARK(EncodeDocuments)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--tokenizer=", 0) == 0)
      g_tokenizer_path = arg.substr(12);
    else if (arg.rfind("--documents=", 0) == 0)
      g_documents_path = arg.substr(12);
    else
      rest.push_back(argv[i]);
  }
  if (g_tokenizer_path.empty() || g_documents_path.empty()) {
    std::fprintf(stderr,
                 "usage: tokenizer_bench --tokenizer=DIR/tokenizer.json --documents=FILE.jsonl "
                 "[benchmark flags]\n");
    return 2;
  }
  benchmark::AddCustomContext("tokenizer", g_tokenizer_path);
  benchmark::AddCustomContext("documents", g_documents_path);
  int rest_count = int(rest.size());
  benchmark::Initialize(&rest_count, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
