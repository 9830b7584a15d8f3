#!/usr/bin/env python3
"""The two Python ends of tools/finetune-example, in a virtual environment with
PyPI transformers and tokenizers:

  make DIR [FAMILY]
             writes DIR/model: a small random model as Hugging Face writes
             one (config.json, model.safetensors) with a tokenizer trained on
             the example's text, and DIR/chats.jsonl: conversations to
             fine-tune on ({"messages": [...]} per line; the assistant answers
             a question about the sum of two numbers). FAMILY qwen2 (the
             default): a Qwen2 model, a byte-level BPE tokenizer of the Qwen2
             kind and a ChatML template. mistral: a Mistral model, a
             SentencePiece-style tokenizer of Mistral v0.3's shape (Metaspace
             with prepend_scheme first, byte fallback with <0x00>..<0xFF>,
             <unk>, a BOS template, a Replace/ByteFallback/Fuse/Strip decoder)
             and Mistral's [INST] template.
  check DIR  loads DIR/finetuned (what `strata train --export` wrote, with the
             tokenizer copied beside it) with transformers, computes the loss
             of held-out conversations on the assistant's tokens, and
             compares it with the random model's: fine-tuning must have
             lowered it.
"""
import json
import os
import random
import sys

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
           "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
           "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
           "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
           "roles are supported!') }}{% endif %}{% endfor %}")
FAMILIES = ("qwen2", "mistral")


def conversation(rng, family="qwen2"):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    # Mistral's template takes no system message; the question says what the system would.
    system = [] if family == "mistral" else [{"role": "system", "content": "You add numbers."}]
    question = f"What is {a} plus {b}?" if system else f"Add the numbers: what is {a} plus {b}?"
    return {"messages": system + [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
    ]}


def sentencepiece_style_tokenizer(texts):
    """Mistral v0.3's tokenizer.json shape, trained on `texts` with a small alphabet."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    # Trained on words (split at "▁"), then used whole as SentencePiece does.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=40, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    data = json.loads(tok.to_str())
    for b in range(256):  # the byte tokens a SentencePiece model with byte_fallback holds
        data["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(data["model"]["vocab"]))
    data["pre_tokenizer"]["split"] = False
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ["<unk>", "<s>", "</s>"]])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def make(out, family="qwen2"):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                              Qwen2ForCausalLM)
    import torch

    rng = random.Random(7)
    chats = [conversation(rng, family) for _ in range(3000)]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "chats.jsonl"), "w") as f:
        for chat in chats:
            f.write(json.dumps(chat) + "\n")
    held_out = [conversation(random.Random(1000 + i), family) for i in range(64)]
    with open(os.path.join(out, "held_out.jsonl"), "w") as f:
        for chat in held_out:
            f.write(json.dumps(chat) + "\n")

    model_dir = os.path.join(out, "model")
    texts = [m["content"] for c in chats for m in c["messages"]] + ["system", "user", "assistant"]
    torch.manual_seed(0)
    if family == "mistral":
        tok = sentencepiece_style_tokenizer(texts)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       unk_token="<unk>")
        fast.chat_template = MISTRAL
        fast.save_pretrained(model_dir)
        config = MistralConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, tie_word_embeddings=False, sliding_window=None)
        model = MistralForCausalLM(config)
        model.save_pretrained(model_dir, safe_serialization=True)
        print(f"wrote {model_dir} (Mistral, {sum(p.numel() for p in model.parameters())} parameters, a "
              f"SentencePiece-style tokenizer with byte fallback, vocabulary {tok.get_vocab_size()}) and "
              f"{len(chats)} conversations")
        return
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(model_dir)

    config = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, use_sliding_window=False)
    Qwen2ForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    print(f"wrote {model_dir} (Qwen2, {sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())} "
          f"parameters, vocabulary {tok.get_vocab_size()}) and {len(chats)} conversations")


def assistant_loss(model_dir, tokenizer_dir, chats):
    """Mean cross-entropy of the assistant's answer tokens (after its header) over the chats."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for chat in chats:
        prompt = tokenizer.apply_chat_template(chat["messages"][:-1], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        full = tokenizer.apply_chat_template(chat["messages"], tokenize=True, return_dict=False)
        ids = torch.tensor([list(full)])
        with torch.no_grad():
            logits = model(ids).logits[0]
        targets = ids[0, 1:]
        losses = torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="none")
        answer = losses[len(prompt) - 1:]
        total += float(answer.sum())
        count += answer.numel()
    return total / count, type(model).__name__


def check(out):
    chats = [json.loads(line) for line in open(os.path.join(out, "held_out.jsonl"))]
    before, _ = assistant_loss(os.path.join(out, "model"), os.path.join(out, "model"), chats)
    after, kind = assistant_loss(os.path.join(out, "finetuned"), os.path.join(out, "model"), chats)
    print(f"transformers loads the fine-tuned model as {kind}; held-out answer loss "
          f"{before:.3f} (random model) -> {after:.3f} (fine-tuned)")
    if not after < before:
        print("the fine-tuned model is not better on held-out answers", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in ("make", "check") or \
            (len(sys.argv) == 4 and (sys.argv[1] != "make" or sys.argv[3] not in FAMILIES)):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(make(*sys.argv[2:]) or 0 if sys.argv[1] == "make" else check(sys.argv[2]))
