"""Reproducible recipe for fuser's small real target/draft model pair.

Steps (all seeded, deterministic file order):
  1. collect_corpus   Python sources of this interpreter's stdlib and installed packages,
                      deduplicated by content, split by file into train / held-out (2%).
  2. train_tokenizer  byte-level BPE (Hugging Face `tokenizers`), specials <|bos|> <|eos|> <|pad|> = 0, 1, 2.
  3. train_target     LlamaForCausalLM, ~10.6M params, bf16 autocast, AdamW, warmup + cosine, time budget.
  4. distill_draft    LlamaForCausalLM, ~1.57M params, KL(target || draft) + a small CE term.
  5. evaluate         held-out perplexity of both, teacher-forced greedy agreement draft vs target.
  6. save_pair        bf16 safetensors + tokenizer into DIR/fuser-code-target and DIR/fuser-code-draft.
  7. pack             DIR's artifacts as models.tar.gz split into <= 15 MiB parts (optional).

Usage:  python models/train.py --out DIR [--smoke] [--pack PACKDIR]
                               [--minutes-target M] [--minutes-draft M] [--max-minutes M] [--corpus-mb MB]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import site
import sys
import sysconfig
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
BOS, EOS, PAD = 0, 1, 2
MB = 1_000_000
MiB = 1 << 20
MAX_FILE_BYTES = 512 * 1024
HELDOUT_PERCENT = 2
HELDOUT_SAMPLE_BYTES = 900 * 1024
PART_BYTES = 15 * MiB
MAX_PARTS = 6
PAIR_LIMIT_BYTES = 25 * MiB
TARGET_DIR, DRAFT_DIR = "fuser-code-target", "fuser-code-draft"
PROBE_FROM, PROBE_TO = 5, 20  # steps timed to fix the schedule length of a time-budgeted run
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


@dataclass(frozen=True)
class Arch:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


@dataclass(frozen=True)
class Recipe:
    corpus_mb: float = 160.0
    tokenizer_sample_mb: float = 40.0
    vocab: int = 4096
    seq_len: int = 512
    batch: int = 128
    target: Arch = Arch(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=960)
    draft: Arch = Arch(hidden=192, layers=2, heads=3, kv_heads=1, intermediate=512)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    ce_weight: float = 0.1  # distillation loss = KL(target || draft) + ce_weight * CE(data)
    minutes_target: float = 4.0
    minutes_draft: float = 2.5
    max_minutes: float = 9.0  # whole-script deadline; training budgets shrink to meet it
    fixed_steps: int | None = None  # exact step count instead of a time budget (smoke)
    eval_seqs: int = 200
    eval_batch: int = 25
    log_every_s: float = 10.0
    min_target_params: int = 10_000_000
    seed: int = 0


SMOKE = Recipe(
    corpus_mb=2.0,
    tokenizer_sample_mb=1.0,
    vocab=512,
    seq_len=64,
    batch=16,
    target=Arch(hidden=96, layers=2, heads=3, kv_heads=1, intermediate=256),
    draft=Arch(hidden=32, layers=1, heads=1, kv_heads=1, intermediate=64),
    warmup_steps=5,
    fixed_steps=30,
    eval_seqs=8,
    eval_batch=4,
    log_every_s=1.0,
    min_target_params=0,
)


@dataclass(frozen=True)
class Doc:
    label: str
    text: str
    sha256: str


@dataclass(frozen=True)
class Corpus:
    train: list[Doc]
    heldout: list[Doc]


@dataclass(frozen=True)
class TrainStats:
    steps: int
    tokens: int
    seconds: float
    final_loss: float  # loss of the last step


# ---------------------------------------------------------------- 1. corpus


def _source_roots() -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]).resolve())]
    for s in [*site.getsitepackages(), paths["purelib"], paths["platlib"]]:
        p = Path(s).resolve()
        if p.is_dir() and all(p != r for _, r in roots):
            roots.append(("site", p))
    return roots


def _candidates() -> list[tuple[str, Path]]:
    """(label, path) of every *.py file <= 512 KB, sorted by label; first root wins a label."""
    found: dict[str, Path] = {}
    for prefix, root in _source_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            # the stdlib folder may contain site-packages: those files get "site/" labels instead
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                path = Path(dirpath, name)
                label = f"{prefix}/{path.relative_to(root).as_posix()}"
                if label not in found and path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
                    found[label] = path
    return sorted(found.items())


def collect_corpus(cap_bytes: int, out: Path) -> Corpus:
    """Read files until cap_bytes, in an order keyed by sha256(label), so a capped corpus samples
    all packages evenly; skip non-UTF-8 and empty files and duplicate contents. Docs sorted by label."""
    candidates = _candidates()
    order = sorted(candidates, key=lambda c: hashlib.sha256(c[0].encode()).hexdigest())
    docs: list[Doc] = []
    seen: set[str] = set()
    total = 0
    for label, path in order:
        if total >= cap_bytes:
            break
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        sha = hashlib.sha256(data).hexdigest()
        if not text.strip() or sha in seen:
            continue
        seen.add(sha)
        docs.append(Doc(label, text, sha))
        total += len(data)
    docs.sort(key=lambda d: d.label)
    heldout = [d for d in docs if int(d.sha256, 16) % 100 < HELDOUT_PERCENT]
    train = [d for d in docs if int(d.sha256, 16) % 100 >= HELDOUT_PERCENT]
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_files.txt").write_text("".join(d.label + "\n" for d in train), encoding="utf-8")
    (out / "heldout_files.txt").write_text("".join(d.label + "\n" for d in heldout), encoding="utf-8")
    log(
        f"corpus: {len(candidates)} candidate files, kept {len(docs)} ({total / MB:.1f} MB): "
        f"train {len(train)} files, held-out {len(heldout)} files"
    )
    return Corpus(train, heldout)


# ---------------------------------------------------------------- 2. tokenizer


def train_tokenizer(docs: list[Doc], vocab: int, sample_bytes: int, seed: int) -> Tokenizer:
    """Byte-level BPE on a seeded sample of the training files (<= sample_bytes)."""
    shuffled = docs[:]
    random.Random(seed).shuffle(shuffled)
    sample, size = [], 0
    for d in shuffled:
        if size + len(d.text) > sample_bytes:
            break
        sample.append(d.text)
        size += len(d.text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample, trainer, length=len(sample))
    assert [tok.token_to_id(s) for s in SPECIALS] == [BOS, EOS, PAD], "special token ids must be 0, 1, 2"
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained on {len(sample)} files ({size / MB:.1f} MB)")
    return tok


def hf_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Transformers wrapper; like training documents, encoded prompts start with <|bos|>."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[BOS],
        eos_token=SPECIALS[EOS],
        pad_token=SPECIALS[PAD],
        add_bos_token=True,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )


def encode_docs(tok: Tokenizer, docs: list[Doc], seq_len: int) -> torch.Tensor:
    """<|bos|> text <|eos|> per file, concatenated and chunked into [n, seq_len] int32 sequences."""
    bos, eos = np.array([BOS], np.int32), np.array([EOS], np.int32)
    pieces: list[np.ndarray] = []
    for i in range(0, len(docs), 4096):
        for enc in tok.encode_batch([d.text for d in docs[i : i + 4096]], add_special_tokens=False):
            pieces += [bos, np.asarray(enc.ids, np.int32), eos]
    stream = np.concatenate(pieces)
    n = len(stream) // seq_len
    return torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len).copy())


# ---------------------------------------------------------------- 3./4. models and training


def build_model(arch: Arch, vocab: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=arch.hidden,
        intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads,
        head_dim=arch.hidden // arch.heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return model


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embedding counted once


def _lr_at(step: int, total: int | None, r: Recipe) -> float:
    if step < r.warmup_steps or total is None:
        return r.lr * min(1.0, (step + 1) / r.warmup_steps)
    progress = min(1.0, (step - r.warmup_steps) / max(1, total - r.warmup_steps))
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _train_loop(
    name: str,
    model: LlamaForCausalLM,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    data: torch.Tensor,
    r: Recipe,
    budget_s: float,
    device: torch.device,
    seed: int,
) -> TrainStats:
    """AdamW with warmup + cosine. Time-budgeted runs time steps PROBE_FROM..PROBE_TO, then fix the
    total step count that fits the budget (and stop anyway once the budget is spent)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": r.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=r.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    gen = torch.Generator().manual_seed(seed)
    total = r.fixed_steps
    order, pos = torch.randperm(len(data), generator=gen).to(data.device), 0  # on device: no per-step sync
    step = tokens = 0
    loss_sum, loss_n = torch.zeros((), device=device), 0
    model.train()
    start = last_log = time.time()
    probe_start = start
    while total is None or step < total:
        if pos + r.batch > len(data):
            order, pos = torch.randperm(len(data), generator=gen).to(data.device), 0
        x = data[order[pos : pos + r.batch]].long()
        pos += r.batch
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, total, r)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_fn(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        loss_sum += loss.detach()
        loss_n += 1
        if total is None and step in (PROBE_FROM, PROBE_TO):
            _sync(device)
            now = time.time()
            if step == PROBE_FROM:
                probe_start = now
            else:
                per_step = (now - probe_start) / (PROBE_TO - PROBE_FROM)
                total = step + max(1, int(0.98 * (budget_s - (now - start)) / per_step))
                log(f"{name}: {per_step * 1e3:.1f} ms/step -> schedule fixed at {total} steps")
        now = time.time()
        over_budget = r.fixed_steps is None and now - start > budget_s
        if now - last_log >= r.log_every_s or step == total or over_budget:
            mean_loss, lr = (loss_sum / loss_n).item(), opt.param_groups[0]["lr"]
            speed = tokens / (time.time() - start)
            log(f"{name}: step {step}/{total or '?'} loss {mean_loss:.4f} lr {lr:.2e} {speed:,.0f} tok/s")
            loss_sum.zero_()
            loss_n, last_log = 0, now
        if over_budget:
            break
    _sync(device)
    return TrainStats(steps=step, tokens=tokens, seconds=time.time() - start, final_loss=loss.item())


def _next_token_ce(logits: torch.Tensor, x: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction=reduction
    )


def train_target(
    model: LlamaForCausalLM, data: torch.Tensor, r: Recipe, budget_s: float, device: torch.device
) -> TrainStats:
    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        return _next_token_ce(model(input_ids=x, use_cache=False).logits, x)

    return _train_loop("target", model, loss_fn, data, r, budget_s, device, seed=r.seed + 1)


def distill_draft(
    draft: LlamaForCausalLM,
    target: LlamaForCausalLM,
    data: torch.Tensor,
    r: Recipe,
    budget_s: float,
    device: torch.device,
) -> TrainStats:
    """loss = KL(softmax(target) || softmax(draft)) per position (temperature 1) + ce_weight * CE."""
    target.eval().requires_grad_(False)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t_logits = target(input_ids=x, use_cache=False).logits
        d_logits = draft(input_ids=x, use_cache=False).logits
        vocab = d_logits.shape[-1]
        t_logp = F.log_softmax(t_logits.float(), dim=-1).reshape(-1, vocab)
        d_logp = F.log_softmax(d_logits.float(), dim=-1).reshape(-1, vocab)
        kl = F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")
        return kl + r.ce_weight * _next_token_ce(d_logits, x)

    return _train_loop("draft", draft, loss_fn, data, r, budget_s, device, seed=r.seed + 2)


# ---------------------------------------------------------------- 5. evaluation


@torch.no_grad()
def evaluate(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, data: torch.Tensor, batch: int, device: torch.device
) -> dict[str, float]:
    """Perplexity (exp of mean next-token CE) of both models and the fraction of positions where the
    draft's argmax equals the target's (teacher-forced on held-out text), in the models' own dtype."""
    target.eval()
    draft.eval()
    ce_t = ce_d = 0.0
    agree = n_pred = n_pos = 0
    for x in data.split(batch):
        x = x.to(device).long()
        lt = target(input_ids=x, use_cache=False).logits
        ld = draft(input_ids=x, use_cache=False).logits
        ce_t += _next_token_ce(lt, x, "sum").item()
        ce_d += _next_token_ce(ld, x, "sum").item()
        n_pred += x[:, 1:].numel()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        n_pos += x.numel()
    return {
        "eval_sequences": len(data),
        "eval_tokens": int(data.numel()),
        "eval_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "ppl_target": math.exp(ce_t / n_pred),
        "ppl_draft": math.exp(ce_d / n_pred),
        "greedy_agreement": agree / n_pos,
    }


# ---------------------------------------------------------------- 6. save


def save_pair(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path
) -> dict[str, int]:
    """bf16 safetensors (transformers 5 always writes safetensors), config, generation config and
    tokenizer per model; returns the size in bytes of each directory."""
    sizes = {}
    for name, model in ((TARGET_DIR, target), (DRAFT_DIR, draft)):
        path = out / name
        shutil.rmtree(path, ignore_errors=True)
        model.to(torch.bfloat16).save_pretrained(path)
        tok.save_pretrained(path)
        assert (path / "model.safetensors").is_file(), f"no model.safetensors in {path}"
        sizes[name] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        log(f"saved {path}: {sizes[name]:,} bytes ({sizes[name] / MiB:.2f} MiB)")
    return sizes


def write_heldout_sample(docs: list[Doc], path: Path) -> int:
    """Held-out files, each after a '# ---- file: LABEL ----' line, whole files only, <= 900 KB."""
    parts, size = [], 0
    for d in docs:
        piece = f"# ---- file: {d.label} ----\n{d.text}"
        if not piece.endswith("\n"):
            piece += "\n"
        n = len(piece.encode("utf-8"))
        if size + n <= HELDOUT_SAMPLE_BYTES:
            parts.append(piece)
            size += n
    path.write_text("".join(parts), encoding="utf-8")
    return len(parts)


# ---------------------------------------------------------------- 7. pack


ARTIFACTS = ("corpus", TARGET_DIR, DRAFT_DIR, "metrics.json", "heldout_sample.txt")


def pack(out: Path, packdir: Path) -> list[Path]:
    """PACKDIR/models.tar.gz of the artifacts, split into models.tar.gz.part-NN of <= 15 MiB.
    Restore with: cat models.tar.gz.part-* | tar xz -C DIR"""
    packdir.mkdir(parents=True, exist_ok=True)
    for old in packdir.glob("models.tar.gz.part-*"):
        old.unlink()
    tar_path = packdir / "models.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for name in ARTIFACTS:
            tar.add(out / name, arcname=name)
    parts = []
    with tar_path.open("rb") as f:
        while chunk := f.read(PART_BYTES):
            part = packdir / f"models.tar.gz.part-{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    tar_path.unlink()
    shutil.copy(out / "metrics.json", packdir / "metrics.json")
    assert len(parts) <= MAX_PARTS, f"{len(parts)} parts > {MAX_PARTS}"
    log(f"packed {len(parts)} part(s) into {packdir}: " + ", ".join(f"{p.name} {p.stat().st_size:,} B" for p in parts))
    return parts


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--smoke", action="store_true", help="tiny corpus/models, fixed 30 steps each (CPU test)")
    ap.add_argument("--pack", type=Path, help="write split models.tar.gz parts and metrics.json here")
    ap.add_argument("--minutes-target", type=float)
    ap.add_argument("--minutes-draft", type=float)
    ap.add_argument("--max-minutes", type=float, help="whole-script deadline (default 9)")
    ap.add_argument("--corpus-mb", type=float)
    args = ap.parse_args()
    r = SMOKE if args.smoke else Recipe()
    overrides = {
        "minutes_target": args.minutes_target,
        "minutes_draft": args.minutes_draft,
        "max_minutes": args.max_minutes,
        "corpus_mb": args.corpus_mb,
    }
    r = replace(r, **{k: v for k, v in overrides.items() if v is not None})

    random.seed(r.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else None
    log(
        f"python {sys.version.split()[0]} torch {torch.__version__} transformers {transformers.__version__} "
        f"tokenizers {tokenizers.__version__} device {device} {gpu or ''} smoke={args.smoke}"
    )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}

    t = time.time()
    corpus = collect_corpus(int(r.corpus_mb * MB), out / "corpus")
    times["corpus_s"] = time.time() - t

    t = time.time()
    tok = train_tokenizer(corpus.train, r.vocab, int(r.tokenizer_sample_mb * MB), r.seed)
    train_data = encode_docs(tok, corpus.train, r.seq_len)
    heldout_data = encode_docs(tok, corpus.heldout, r.seq_len)[: r.eval_seqs]
    assert len(train_data) >= r.batch and len(heldout_data) > 0, (train_data.shape, heldout_data.shape)
    times["tokenize_s"] = time.time() - t
    log(
        f"{r.seq_len}-token sequences: {len(train_data):,} train ({train_data.numel():,} tok), {len(heldout_data)} eval"
    )

    torch.manual_seed(r.seed)
    target = build_model(r.target, r.vocab)
    torch.manual_seed(r.seed + 1)
    draft = build_model(r.draft, r.vocab)
    p_target, p_draft = n_params(target), n_params(draft)
    log(f"params: target {p_target:,}  draft {p_draft:,}  ratio {p_target / p_draft:.2f}")
    assert p_target >= r.min_target_params, f"target has {p_target:,} < {r.min_target_params:,} params"
    assert 6 * p_draft <= p_target, "draft must have at most 1/6 of the target's parameters"
    if not args.smoke:  # fail before training if bf16 weights alone cannot fit the size limit
        assert 2 * (p_target + p_draft) < PAIR_LIMIT_BYTES - MiB, "bf16 weights too large"

    # Training budgets: as asked, but shrunk proportionally to end by the whole-script deadline
    # (reserving a minute for evaluation, saving and packing).
    asked = 60 * (r.minutes_target + r.minutes_draft)
    available = 60 * r.max_minutes - (time.time() - T0) - 60
    scale = min(1.0, max(available, 60.0) / asked)
    if scale < 1.0:
        log(f"WARNING: shrinking training budgets to {scale:.0%} to meet --max-minutes {r.max_minutes}")
    budget_target, budget_draft = 60 * r.minutes_target * scale, 60 * r.minutes_draft * scale
    if r.fixed_steps is None:
        log(f"training budgets: target {budget_target:.0f} s, draft {budget_draft:.0f} s")

    n_train_seqs = len(train_data)
    train_data = train_data.to(device)
    target.to(device)
    stats_target = train_target(target, train_data, r, budget_target, device)
    times["target_s"] = stats_target.seconds
    draft.to(device)
    stats_draft = distill_draft(draft, target, train_data, r, budget_draft, device)
    times["draft_s"] = stats_draft.seconds
    del train_data

    t = time.time()
    target.to(torch.bfloat16)
    draft.to(torch.bfloat16)
    results = evaluate(target, draft, heldout_data, r.eval_batch, device)
    times["eval_s"] = time.time() - t
    log("eval: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in results.items()))

    sizes = save_pair(target, draft, hf_tokenizer(tok), out)
    pair_bytes = sum(sizes.values())
    n_sample = write_heldout_sample(corpus.heldout, out / "heldout_sample.txt")
    times["total_s"] = time.time() - T0
    metrics = {
        "recipe": asdict(r),
        "smoke": args.smoke,
        "params_target": p_target,
        "params_draft": p_draft,
        **results,
        "tokens_trained_target": stats_target.tokens,
        "tokens_trained_draft": stats_draft.tokens,
        "steps_target": stats_target.steps,
        "steps_draft": stats_draft.steps,
        "final_train_loss_target": stats_target.final_loss,
        "final_train_loss_draft": stats_draft.final_loss,
        "corpus_files_train": len(corpus.train),
        "corpus_files_heldout": len(corpus.heldout),
        "corpus_bytes": sum(len(d.text.encode("utf-8")) for d in corpus.train + corpus.heldout),
        "train_sequences": n_train_seqs,
        "train_tokens_per_epoch": n_train_seqs * r.seq_len,
        "heldout_sample_files": n_sample,
        "dir_bytes": sizes,
        "pair_bytes": pair_bytes,
        "wall_times_s": {k: round(v, 1) for k, v in times.items()},
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "device": str(device),
        "gpu": gpu,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    if args.pack:
        pack(out, args.pack)

    log("=" * 72)
    for name, p, st, ppl in (
        ("target", p_target, stats_target, "ppl_target"),
        ("draft", p_draft, stats_draft, "ppl_draft"),
    ):
        log(f"{name:6} {p:,} params, {st.steps} steps, {st.tokens:,} tokens, held-out ppl {results[ppl]:.3f}")
    log(f"greedy agreement draft vs target: {results['greedy_agreement']:.4f} ({results['eval_tokens']:,} tokens)")
    log(f"model dirs: {pair_bytes:,} bytes ({pair_bytes / MiB:.2f} MiB; limit {PAIR_LIMIT_BYTES / MiB:.0f} MiB)")
    log(f"wrote {out}/{{{','.join(ARTIFACTS)}}}" + (f"; parts in {args.pack}" if args.pack else ""))
    if not args.smoke:
        assert pair_bytes <= PAIR_LIMIT_BYTES, f"model dirs {pair_bytes:,} bytes > {PAIR_LIMIT_BYTES:,}"


if __name__ == "__main__":
    main()
