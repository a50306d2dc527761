"""The shipped weights as a Hugging Face model: the one owner of that conversion.

    python -m minibatch.export hf OUT_DIR [--model target|draft|llama] [--force]

writes ``OUT_DIR/config.json`` and ``OUT_DIR/model.safetensors``, a ``GPT2LMHeadModel`` (the GPTs) or
``LlamaForCausalLM`` (the Llama) directory that transformers (``from_pretrained``) and vLLM
(``LLM(model=OUT_DIR, skip_tokenizer_init=True)``) load.
The bench peers (``minibatch/bench/peers.py``, ``vllm_peer.py``) and their tests convert through here.

The conversion is exact because the shipped GPT is GPT-2 (``minibatch/model/model.py``): wte, wpe, per
block ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, then ln_f and a head tied to wte.
transformers' GPT-2 stores those projections as ``Conv1D`` (y = x W + b, W [in, out]) where ``nn.Linear``
stores W [out, in], so their weights transpose. tanh-GELU is HF's ``"gelu_new"``; the LayerNorm eps is
copied (nn.LayerNorm's 1e-5, not GPT2Config's default); dropout is 0. The Llama (``model/llama.py``) uses
Hugging Face's module names and rotary convention already, so its conversion is a prefix (``model.``) and its
config's field names. A byte model has no tokenizer files of its own:
its token ids are the bytes (``minibatch/model/tokenizer.py``), so an offline peer takes token ids, not text.
A server streams text, so ``--tokenizer`` (``tokenizer=True``) also writes ``tokenizer.json`` and
``tokenizer_config.json``: a byte-level BPE (``write_byte_tokenizer``) whose ids are minibatch's, which
``vllm serve OUT_DIR`` loads (``bench serve --peer vllm``, ``minibatch/bench/vllm_serve.py``).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from minibatch.model.llama import Llama
from minibatch.model.model import GPT

PAD = 0                                  # byte 0 (NUL) never occurs in code; peers mask it out anyway
MODELS = ("target", "draft", "llama")    # the shipped models (the speculative heads are not models of their own)


def hf_config(model, n_positions: int | None = None) -> dict:
    """The Hugging Face config's fields for `model` (GPT2Config's or LlamaConfig's); for a GPT, n_positions >
    n_ctx pads position embeddings (see hf_state_dict)."""
    if isinstance(model, Llama):
        c = model.config
        return dict(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
                    head_dim=c.head_dim, max_position_embeddings=c.n_ctx, rms_norm_eps=c.rms_norm_eps,
                    rope_theta=c.rope_theta, hidden_act="silu", attention_bias=False, mlp_bias=False,
                    tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=PAD)
    if not isinstance(model, GPT):
        raise TypeError(f"the conversion needs a minibatch GPT or Llama, got {type(model).__name__}")
    c = model.config
    n_positions = c.n_ctx if n_positions is None else n_positions
    if n_positions < c.n_ctx:
        raise ValueError(f"n_positions must be >= the model's context {c.n_ctx}, got {n_positions}")
    return dict(vocab_size=c.vocab_size, n_positions=n_positions, n_embd=c.n_embd, n_layer=c.n_layer,
                n_head=c.n_head, activation_function="gelu_new", layer_norm_epsilon=model.h[0].ln_1.eps,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                bos_token_id=None, eos_token_id=None, pad_token_id=PAD)


def hf_state_dict(model, n_positions: int | None = None) -> dict:
    """``GPT2LMHeadModel``'s (or ``LlamaForCausalLM``'s) tensors (float32, CPU), the head left out: it is tied to
    the token embedding.

    n_positions > n_ctx appends zero position embeddings, for padded static batches only: a member that
    finished keeps computing thrown-away tokens until the batch's longest is done, and may run past the
    n_ctx learned positions; its useful tokens never do (prompt + max_tokens <= n_ctx).
    """
    if isinstance(model, Llama):
        return {f"model.{name}": t.detach().to("cpu", torch.float32).contiguous()
                for name, t in model.state_dict().items()}
    c, n_positions = model.config, hf_config(model, n_positions)["n_positions"]
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith(".weight") and name.split(".")[-2] in ("c_attn", "c_proj", "c_fc"):
            t = t.t()                                  # nn.Linear [out, in] -> Conv1D [in, out]
        if name == "wpe.weight":                       # [n_ctx, C] -> [n_positions, C]
            t = torch.cat([t, t.new_zeros(n_positions - c.n_ctx, c.n_embd)])
        state[f"transformer.{name}"] = t.detach().to("cpu", torch.float32).contiguous()
    return state


def to_hf(model, n_positions: int | None = None):
    """The same weights as a transformers ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (float32, CPU, eval mode,
    dropout 0)."""
    if isinstance(model, Llama):
        from transformers import LlamaConfig, LlamaForCausalLM
        hf = LlamaForCausalLM(LlamaConfig(**hf_config(model)))
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        hf = GPT2LMHeadModel(GPT2Config(**hf_config(model, n_positions)))
    missing, unexpected = hf.load_state_dict(hf_state_dict(model, n_positions), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"conversion mismatch: missing {missing}, unexpected {unexpected}")
    if hf.lm_head.weight.data_ptr() != hf.get_input_embeddings().weight.data_ptr():
        raise RuntimeError("the converted LM head is not tied to the token embedding")
    return hf.eval().requires_grad_(False)


def bytes_to_unicode() -> dict:
    """GPT-2's map of the 256 bytes to printable characters (its ``encoder.py``): a byte-level BPE's symbols.
    The printable Latin-1 bytes stand for themselves; the other 68 (controls, space, 0x7f-0xa0, 0xad) are
    shifted to U+0100.. so that no symbol is whitespace or a control a pre-tokenizer would drop."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = iter(range(256, 256 + 256 - len(keep)))
    return {b: chr(b if b in keep else next(shifted)) for b in range(256)}


def write_byte_tokenizer(out_dir, model_max_length: int) -> pathlib.Path:
    """``tokenizer.json`` + ``tokenizer_config.json`` in `out_dir`: minibatch's tokenizer as a Hugging Face fast
    tokenizer. A byte-level BPE with the 256 byte symbols as its vocabulary (id = the byte's value) and no
    merges, so every byte is one token, as in ``minibatch/model/tokenizer.py``; no special tokens, none added
    (the model has no BOS or EOS). Needs the ``tokenizers`` library (transformers' own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    symbol = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={symbol[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)   # text -> byte symbols
    tok.decoder = decoders.ByteLevel()                  # symbols -> bytes -> text (invalid UTF-8 -> U+FFFD)
    out = pathlib.Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    # clean_up_tokenization_spaces off: transformers would otherwise drop the space in " ." on decode.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_hf(model, out_dir, force: bool = False, tokenizer: bool = False) -> pathlib.Path:
    """Write `model` as a GPT2LMHeadModel or LlamaForCausalLM directory (config.json, model.safetensors, and with
    `tokenizer` the byte tokenizer's files); transformers not needed."""
    from safetensors.torch import save_file
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} is not empty; pass --force (force=True) to write over it")
    out.mkdir(parents=True, exist_ok=True)
    arch, kind = ("LlamaForCausalLM", "llama") if isinstance(model, Llama) else ("GPT2LMHeadModel", "gpt2")
    config = {"architectures": [arch], "model_type": kind, "torch_dtype": "float32", **hf_config(model)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer:
        write_byte_tokenizer(out, model.config.n_ctx)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minibatch.export", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="format", required=True)
    hf = sub.add_parser("hf", help="a transformers GPT2LMHeadModel or LlamaForCausalLM directory (config.json + "
                                   "model.safetensors)")
    hf.add_argument("out_dir")
    hf.add_argument("--model", default="target", help=f"shipped model: one of {list(MODELS)}")
    hf.add_argument("--force", action="store_true", help="write into a non-empty directory")
    hf.add_argument("--tokenizer", action="store_true",
                    help="also the byte tokenizer (tokenizer.json), for servers that stream text (vllm serve)")
    args = ap.parse_args(argv)
    from minibatch.model.weights import load_model
    try:
        if args.model not in MODELS:
            raise ValueError(f"unknown model {args.model!r}; choose one of {list(MODELS)}")
        out = export_hf(load_model(args.model, device="cpu"), args.out_dir, force=args.force,
                        tokenizer=args.tokenizer)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"wrote {args.model} as {arch} to {out}/ (config.json, model.safetensors"
          f"{', tokenizer.json' if args.tokenizer else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
