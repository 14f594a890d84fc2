"""Training a DFlash draft by self-distillation (paper §4.2 / SpecForge ``core/dflash.py``).

Per sequence, random anchors are drawn in the response region (fresh every step, so every
epoch sees new ones). Each anchor opens a block ``[token at anchor, MASK x (B-1)]`` at
positions ``anchor .. anchor+B-1``, embedded with the target's frozen embedding. All blocks
of a sequence run in one draft pass: a block attends bidirectionally to itself and to the
fused target features of positions strictly before its anchor (``attention_mask`` with one
block id per anchor), never to other blocks. Block position k predicts the token at
``anchor + k`` (same-position labels) through the draft's own final norm and the target's
frozen LM head, weighted by ``exp(-(k-1)/gamma)``. When the dataset stores the target's
argmax per position, that is the label (greedy verification accepts exactly the argmax), and
block position k > 1 only counts where the data tokens at positions 1..k-1 of the block are
themselves the argmax: greedy verification only reaches position k along that path
(``labels="greedy"``). ``labels="soft"`` keeps that mask but trains on the target's
distribution there: cross-entropy against its ``soft_k`` most likely tokens, their stored
probabilities renormalized (with ``soft_k=1`` exactly the greedy loss). AdamW, linear warmup then cosine decay,
grad-norm clip 1.0. Only draft parameters train. Data order and anchors are a pure function
of (seed, step), so a resumed run continues exactly where it stopped.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .config import DraftConfig
from .draft import DFlashDraft, attention_mask
from .train_data import Sample


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for B=16, 5 for B=10, 4 for B=8 (and below)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


@dataclass
class TrainConfig:
    steps: int = 1000
    batch: int = 4              # sequences per optimizer step
    anchors: int = 32           # blocks per sequence
    lr: float = 6e-4
    warmup: float = 0.04        # fraction of steps
    weight_decay: float = 0.01
    gamma: float = 7.0
    grad_clip: float = 1.0
    seed: int = 0
    # "full": softmax over the whole vocabulary. "data": over the tokens that occur in the
    # dataset plus ``negatives`` random others, fresh each step (a sampled softmax: several
    # times cheaper on CPU, where the LM head dominates the step)
    head_vocab: str = "full"
    negatives: int = 4096
    amp: bool = False           # bf16 autocast for the draft layers (fp32 master weights)
    # "greedy": train on the target's stored argmax (samples without it fall back to their
    # tokens); "sampled": on the data tokens; "soft": on the target's stored top-``soft_k``
    # distribution (every sample must have soft labels)
    labels: str = "greedy"
    soft_k: int = 16


class DraftTrainer:
    """Trains ``DraftConfig`` on samples; ``embed`` is the target's embedding module and
    ``head_weight`` its LM head matrix (both frozen). ``norm_weight`` (the target's final norm)
    initialises the draft's final norm, so the borrowed head starts at a sane logit scale.
    ``init``: start from these draft weights instead (z-lab names; fine-tuning a draft)."""

    def __init__(self, cfg: DraftConfig, samples: list[Sample], embed, head_weight: torch.Tensor,
                 tc: TrainConfig, *, device="cpu", ckpt_dir: str | Path | None = None, resume: bool = False,
                 head_dtype: torch.dtype = torch.bfloat16, norm_weight: torch.Tensor | None = None,
                 init: dict[str, torch.Tensor] | None = None):
        if not samples:
            raise ValueError("no training samples")
        if tc.labels not in ("greedy", "sampled", "soft"):
            raise ValueError(f"labels must be greedy, sampled or soft, got {tc.labels!r}")
        if tc.labels == "soft":
            if tc.soft_k < 1:
                raise ValueError(f"soft_k must be at least 1, got {tc.soft_k}")
            if any(s.soft_ids is None or s.targets is None for s in samples):
                raise ValueError("labels 'soft' needs the target's stored distribution in every sample: "
                                 "a dataset sampled before soft labels were kept has none (sample a new one)")
        self.cfg, self.samples, self.tc, self.device = cfg, samples, tc, torch.device(device)
        self.embed, self.head_dtype = embed, head_dtype
        self.head = head_weight.detach().to(self.device, head_dtype)
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir else None
        self.max_len = max(len(s.ids) for s in samples)
        self.step, self.history = 0, []
        state = None
        if resume and self.ckpt_dir and (self.ckpt_dir / "state.json").is_file():
            state, tensors = self._read_checkpoint()
        elif init is not None:
            tensors = {k: v.float() if v.is_floating_point() else v for k, v in init.items()}
        else:
            tensors = DFlashDraft.random_tensors(cfg, tc.seed)
            if norm_weight is not None:
                tensors["norm.weight"] = norm_weight.detach().float().cpu().clone()
        self.vocab = torch.cat([s.ids for s in samples]).unique() if tc.head_vocab == "data" else None
        self.draft = DFlashDraft(cfg, tensors, self.device, torch.float32, self.max_len)
        self.params = list(self.draft.parameters())
        for p in self.params:
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.params, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
        if state is not None:
            self._load_optimizer(state)
        self._perms: dict[int, torch.Tensor] = {}

    # --- schedule and sampling (pure functions of seed and step) ---------------------
    def lr_at(self, step: int) -> float:
        warm = max(1, int(self.tc.warmup * self.tc.steps))
        if step < warm:
            return self.tc.lr * (step + 1) / warm
        t = (step - warm) / max(1, self.tc.steps - warm)
        return self.tc.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    def batch_indices(self, step: int) -> list[int]:
        n, out = len(self.samples), []
        for i in range(self.tc.batch):
            g = step * self.tc.batch + i
            epoch = g // n
            if epoch not in self._perms:
                self._perms = {epoch: torch.randperm(n, generator=torch.Generator().manual_seed(
                    self.tc.seed * 7919 + epoch))}
            out.append(int(self._perms[epoch][g % n]))
        return out

    def anchors_for(self, sample: Sample, step: int, j: int) -> torch.Tensor:
        """Sorted distinct anchors in [prompt_len, L-2] (each has at least one label)."""
        lo, hi = sample.prompt_len, len(sample.ids) - 1
        g = torch.Generator().manual_seed((self.tc.seed * 1_000_003 + step) * 131 + j)
        pick = torch.randperm(hi - lo, generator=g)[:self.tc.anchors] + lo
        return pick.sort().values

    # --- the loss ------------------------------------------------------------------------
    def _blocks(self, sample: Sample, anchors: torch.Tensor) -> torch.Tensor:
        """Final-normed draft hidden states (A, B, H) for the blocks at ``anchors``."""
        d, B, dev = self.draft, self.cfg.block_size, self.device
        A, Lc = len(anchors), int(anchors[-1])
        ctx = d.hidden_norm(d.fc(sample.features[None, :Lc].to(dev, torch.float32)))
        cpos = torch.arange(Lc, device=dev)
        anchors = anchors.to(dev)
        bpos = (anchors[:, None] + torch.arange(B, device=dev)).reshape(-1)
        ids = torch.full((A, B), self.cfg.mask_token_id, dtype=torch.long)
        ids[:, 0] = sample.ids[anchors.cpu()]
        with torch.no_grad():
            # the draft reads the raw embedding rows x input_embedding_scale (as DFlashProposer does)
            x = torch.nn.functional.embedding(ids.reshape(1, -1).to(self.embed.weight.device), self.embed.weight)
            x = x.to(dev, torch.float32) * self.cfg.input_embedding_scale
        q_block = torch.arange(A, device=dev).repeat_interleave(B)
        k_pos = torch.cat([cpos, bpos])
        k_block = torch.cat([torch.full((Lc,), -1, device=dev), q_block])
        cos_c, sin_c = d.rope.cos[cpos], d.rope.sin[cpos]
        cos_b, sin_b = d.rope.cos[bpos], d.rope.sin[bpos]
        masks = {}
        for layer in d.layers:
            key = (layer.causal, layer.window)
            if key not in masks:
                masks[key] = attention_mask(bpos, anchors.repeat_interleave(B), q_block, k_pos, k_block, *key)
            ck, cv = layer.project_kv(ctx, cos_c, sin_c)
            x = layer(x, cos_b, sin_b, ck, cv, masks[key])
        return d.norm(x)[0].view(A, B, -1)

    def labels(self, s: Sample, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """Labels and loss weights (A, B-1) for block positions 1..B-1 at ``anchors``, and
        with soft labels their (ids, probabilities) (A, B-1, soft_k), else None."""
        k = torch.arange(1, self.cfg.block_size)
        pos = anchors[:, None] + k
        valid = pos < len(s.ids)
        pos = pos.clamp(max=len(s.ids) - 1)
        soft = None
        if self.tc.labels in ("greedy", "soft") and s.targets is not None:
            y = s.targets[pos]
            on_path = (s.ids[pos] == y).int().cumprod(-1)          # data == argmax up to here
            valid = valid & torch.cat([torch.ones_like(on_path[:, :1]), on_path[:, :-1]], -1).bool()
            if self.tc.labels == "soft":
                ids, p = s.soft_ids[pos][..., :self.tc.soft_k].long(), s.soft_p[pos][..., :self.tc.soft_k].float()
                p = p * (ids >= 0)
                total = p.sum(-1, keepdim=True)
                valid = valid & (total[..., 0] > 0)
                soft = (ids.clamp(min=0), p / total.clamp(min=1e-30))
        else:
            y = s.ids[pos]
        return y, valid * torch.exp(-(k - 1) / self.tc.gamma), soft

    def loss(self, samples: list[Sample], anchors: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        B, dev = self.cfg.block_size, self.device
        hidden, labels, weights, softs = [], [], [], []
        for s, a in zip(samples, anchors):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.tc.amp):
                hidden.append(self._blocks(s, a)[:, 1:].float())
            y, w, soft = self.labels(s, a)
            labels.append(y)
            weights.append(w)
            softs.append(soft)
        h = torch.cat(hidden).reshape(-1, self.cfg.hidden_size)
        y = torch.cat(labels).reshape(-1).to(dev)
        w = torch.cat(weights).reshape(-1).to(dev, torch.float32)
        soft = None
        if self.tc.labels == "soft":
            K = softs[0][0].shape[-1]
            soft = (torch.cat([x[0] for x in softs]).reshape(-1, K), torch.cat([x[1] for x in softs]).reshape(-1, K))
        head = self.head
        if self.vocab is not None:
            g = torch.Generator().manual_seed(self.tc.seed * 7_777_777 + self.step)
            cand = [self.vocab, torch.randint(0, self.head.shape[0], (self.tc.negatives,), generator=g)]
            cand = torch.cat(cand + ([soft[0].reshape(-1)] if soft is not None else [])).unique()
            head, y = self.head[cand.to(dev)], torch.searchsorted(cand, y.cpu()).to(dev)
            if soft is not None:
                soft = (torch.searchsorted(cand, soft[0]), soft[1])
        logits = F.linear(h.to(self.head_dtype), head).float()
        if soft is None:
            ce = F.cross_entropy(logits, y, reduction="none")
        else:   # -sum_k p_k log q(id_k): the cross-entropy against the target's (renormalized) top-K
            logq = torch.log_softmax(logits, dim=-1).gather(-1, soft[0].to(dev))
            ce = -(soft[1].to(dev) * logq).sum(-1)
        loss = (ce * w).sum() / w.sum()
        with torch.no_grad():
            hit = (logits.argmax(-1) == y) & (w > 0)
            hit = hit.view(-1, B - 1)
            # teacher-forced acceptance length: 1 + accepted prefix per block
            tau = 1 + hit.int().cumprod(-1).sum(-1).float().mean()
            metrics = {"loss": float(loss), "acc1": float(hit[:, 0].float().mean()), "tau_tf": float(tau)}
        return loss, metrics

    # --- the loop ------------------------------------------------------------------------
    def train_step(self) -> dict:
        idx = self.batch_indices(self.step)
        samples = [self.samples[i] for i in idx]
        anchors = [self.anchors_for(s, self.step, j) for j, s in enumerate(samples)]
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        loss, m = self.loss(samples, anchors)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, self.tc.grad_clip))
        self.opt.step()
        m.update(step=self.step, lr=self.opt.param_groups[0]["lr"])
        self.step += 1
        self.history.append(m)
        return m

    def train(self, until: int | None = None, *, ckpt_every: int = 0, eval_every: int = 0, eval_fn=None,
              log_path: str | Path | None = None, progress: bool = True) -> dict:
        """Run to step ``until`` (default: all steps). ``eval_fn(trainer) -> dict`` is shown in
        the progress bar (e.g. held-out acceptance length) and logged."""
        until = self.tc.steps if until is None else min(until, self.tc.steps)
        bar = tqdm(total=self.tc.steps, initial=self.step, desc="training draft", unit="step",
                   disable=None if progress else True)
        shown, ev, ema = {}, {}, None
        log = open(log_path, "a") if log_path else None
        try:
            while self.step < until:
                m = self.train_step()
                ema = m["loss"] if ema is None else 0.9 * ema + 0.1 * m["loss"]
                shown.update(loss=f"{ema:.3f}", acc1=f"{m['acc1']:.2f}", tau_tf=f"{m['tau_tf']:.2f}")
                done = self.step == until
                if eval_fn and ((eval_every and self.step % eval_every == 0) or done):
                    ev = eval_fn(self)
                    m.update(ev)
                    shown.update({k: f"{v:.2f}" for k, v in ev.items()})
                if log:
                    log.write(json.dumps(m) + "\n")
                    log.flush()
                bar.set_postfix(shown)
                bar.update(1)
                if self.ckpt_dir and ((ckpt_every and self.step % ckpt_every == 0) or done):
                    self.save_checkpoint()
        finally:
            bar.close()
            if log:
                log.close()
        return ev

    # --- weights, checkpoints, export ----------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.draft.zlab_state_dict().items()}

    def inference_draft(self, device="cpu", dtype=torch.float32, max_ctx: int = 4096) -> DFlashDraft:
        return DFlashDraft(self.cfg, self.tensors(), device, dtype, max_ctx)

    def export(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """z-lab format: config.json + model.safetensors."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.tensors().items()},
                  str(out / "model.safetensors"))
        return out

    def save_checkpoint(self) -> None:
        from safetensors.torch import save_file

        tmp = self.ckpt_dir.with_name(self.ckpt_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(self.tensors(), str(tmp / "draft.safetensors"))
        opt = {}
        for i, p in enumerate(self.params):
            for name, t in self.opt.state.get(p, {}).items():
                opt[f"{i}.{name}"] = t.detach().cpu().reshape(-1).contiguous() if t.dim() == 0 else t.detach().cpu()
        save_file(opt, str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"step": self.step, "draft_config": self.cfg.to_dict(),
                                                    "train_config": asdict(self.tc),
                                                    "history": self.history[-50:]}, indent=1))
        old = self.ckpt_dir.with_name(self.ckpt_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if self.ckpt_dir.exists():
            self.ckpt_dir.replace(old)
        tmp.replace(self.ckpt_dir)
        shutil.rmtree(old, ignore_errors=True)

    def _read_checkpoint(self) -> tuple[dict, dict]:
        from safetensors.torch import load_file

        state = json.loads((self.ckpt_dir / "state.json").read_text())
        if DraftConfig.from_dict(state["draft_config"]) != self.cfg:
            raise ValueError(f"{self.ckpt_dir}: checkpoint is for another draft configuration")
        self.step = int(state["step"])
        return state, load_file(str(self.ckpt_dir / "draft.safetensors"))

    def _load_optimizer(self, state: dict) -> None:
        from safetensors.torch import load_file

        saved = load_file(str(self.ckpt_dir / "optimizer.safetensors"))
        for i, p in enumerate(self.params):
            st = {name.split(".", 1)[1]: t for name, t in saved.items() if name.split(".", 1)[0] == str(i)}
            if st:
                st["step"] = st["step"].reshape(())
                self.opt.state[p] = {k: v.to(p.device) if k != "step" else v for k, v in st.items()}
        self.history = list(state.get("history", []))
