"""Batched token sampling with vLLM's semantics.

One call samples one token for each row of a ``[num_rows, vocab]`` logits
tensor. Per row, in this order: logit_bias, allowed_token_ids (every other
token to -inf), the bans (min_tokens on EOS and stop tokens, and bad_words: a
bad word's last token wherever the tokens just generated are the rest of it),
repetition penalty (prompt + output), frequency and presence penalties (output
only); then greedy rows take the argmax and the others are divided by their
temperature, filtered by top-k, top-p and min-p, and sampled. A row that the
allowed ids or the bans would leave with no token at all keeps its logits from
before them (as a grammar's end wins over the min_tokens ban), so every row
always has a token to sample.

Every transform is one tensor operation over all rows that use it, and a
transform no row uses is skipped, so an all-greedy batch without penalties
costs one argmax and one logsumexp (for the chosen token's logprob); the
full log-softmax is computed only when a row asks for logprobs.

A grammar mask (structured outputs) comes first: it sets the tokens a
constrained row's grammar forbids to -inf in one batched op, so every later
step, and the reported logprobs, see the constrained distribution. Where the
grammar allows nothing but tokens the min_tokens ban would remove (its
document is complete and may only end), the grammar's end wins and the ban is
not applied to that row: no row is ever left with every token forbidden.

Sampling uses the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)``
i.i.d. per token picks token ``i`` with probability ``p_i``. A row with a seed
draws its ``q`` from its own generator, exactly ``vocab`` numbers per step, so
its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.native import cpu_ops
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.bitmask import GrammarMask


@dataclass(slots=True)
class SamplingRow:
    """One row of logits: the sequence sampled from it and what sampling needs to know.

    ``token_ids`` is the sequence's own list (prompt, then outputs), read and
    never copied: most steps need only the number of outputs (min_tokens), so
    a row costs nothing per generated token. The sampler reads it during the
    call only.
    """

    params: SamplingParams
    token_ids: Sequence[int]  # the prompt's prompt_len tokens, then those generated so far
    prompt_len: int
    generator: torch.Generator | None  # the sequence's own generator when params.seed is set
    eos_token_ids: Sequence[int] = ()  # banned with params.stop_token_ids until min_tokens outputs

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Generated so far (penalties); a copy, so only when a penalty needs the tokens."""
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class SamplerOutput:
    """Per row: the chosen token and its logprob under the raw (unprocessed) distribution."""

    token_ids: list[int]
    logprobs: list[float]
    # When any row asked for logprobs: its params.logprobs best (id, logprob) pairs, or the pairs of its
    # params.logprob_token_ids in their order; [] otherwise.
    top_logprobs: list[list[tuple[int, float]]] | None
    ranks: list[int] | None  # 1 = the most likely token under the raw distribution
    # per row, the ranks of its top_logprobs' tokens where they are logprob_token_ids; None: best first
    top_ranks: list[list[int] | None] | None = None


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the vocabulary in float32; ``[rows, vocab]`` in and out."""
    return torch.log_softmax(logits.float(), dim=-1)


def top_k_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logprobs of each row and their token ids, best first; each ``[rows, k]``."""
    values, ids = torch.topk(logprobs, k, dim=-1)
    return values, ids


class Sampler:
    """Stateless: all per-sequence state (outputs so far, generators) comes in the rows."""

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], grammar_mask: GrammarMask | None = None
    ) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        logits = logits.float()
        if grammar_mask is not None:
            logits = grammar_mask.apply(logits)  # in place; constrained rows' logprobs are the masked ones
        if any(r.params.num_logprobs is not None for r in rows):
            raw_logprobs = compute_logprobs(logits)  # [rows, vocab]
            token_ids = _choose_tokens(_apply_logit_processors(logits, rows), rows)  # [rows]
            return _gather_logprobs(raw_logprobs, token_ids, rows)
        token_ids, chosen = self._sample_masked(logits, rows)
        return SamplerOutput(token_ids.tolist(), chosen.tolist(), None, None)

    def sample_tensors(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], grammar_mask: GrammarMask | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [rows] int64, their logprobs [rows] fp32), left on the logits' device.

        For rows that ask for no top logprobs. Nothing here waits for the device,
        so a caller can launch more work before reading the results. A grammar
        mask sets the forbidden tokens of its rows to -inf first (one batched op).
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        logits = logits.float()
        if grammar_mask is not None:
            logits = grammar_mask.apply(logits)
        return self._sample_masked(logits, rows)

    def _sample_masked(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """``sample_tensors`` on float32 logits that the grammar mask (if any) was already applied to."""
        # Only the chosen tokens' logprobs are reported: logit - logsumexp, without
        # materialising the whole log-softmax.
        argmax = None
        native = cpu_ops.usable_for(logits)  # a float32 CPU tensor here
        if native and all(r.params.is_greedy for r in rows) and not _has_processors(rows):
            return cpu_ops.greedy_pick(logits)  # one pass over each row: the maximum and its logprob
        if native:
            argmax, normaliser = cpu_ops.argmax_logsumexp(logits)  # one pass over each row
        else:
            normaliser = torch.logsumexp(logits, dim=-1)  # [rows]
        processed = _apply_logit_processors(logits, rows)
        if argmax is not None and processed is logits and all(r.params.is_greedy for r in rows):
            token_ids = argmax
        else:
            token_ids = _choose_tokens(processed, rows)
        chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - normaliser
        return token_ids, chosen


def sample_generator(seed: int | None, sample_index: int, device: torch.device) -> torch.Generator | None:
    """Per-sequence generator: sample i of a seeded request draws from its own stream."""
    if seed is None:
        return None
    stream_seed = seed if sample_index == 0 else hash((seed, sample_index)) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator(device=device).manual_seed(stream_seed)


def on_device(values: list, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``; on CUDA through pinned memory.

    A copy from pageable memory waits for all work queued before it, which
    would stall the host behind a forward pass it means to overlap.
    """
    return _move(torch.tensor(values), device)


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto ``device`` without waiting for the device's queue (see on_device)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# ---------------------------------------------------------------- logit processors


def _has_processors(rows: Sequence[SamplingRow]) -> bool:
    """Whether any row asks for a logit processor: the fields :func:`_apply_logit_processors`
    reads (it returns the logits untouched where this is False; a new processor's field goes here)."""
    return any(
        p.logit_bias or p.allowed_token_ids or p.min_tokens or p.bad_words_token_ids
        or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        for p in (r.params for r in rows)
    )


def _apply_logit_processors(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Bias, allowed ids, bans and penalties; returns a new tensor only when something applies.

    The order is the pipeline's: additive bias, then allowed_token_ids and the
    bans (min_tokens, bad words; a grammar's bitmask, applied to ``logits``
    before, is one more ban at this point), then penalties. A ban that would
    leave a row without a token is not applied to it (``_ban``).
    """
    if not _has_processors(rows):
        return logits
    vocab = logits.shape[1]
    bias = _sparse_entries(rows, vocab, _bias_entries)
    allowed_rows = [i for i, r in enumerate(rows) if r.params.allowed_token_ids]
    banned = _sparse_entries(rows, vocab, _min_tokens_ban_entries)
    bad_words = _sparse_entries(rows, vocab, _bad_word_entries)
    uses_repetition = any(r.params.repetition_penalty != 1.0 for r in rows)
    uses_output_penalty = any(
        r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in rows
    )
    if (bias is None and banned is None and bad_words is None and not allowed_rows and not uses_repetition
            and not uses_output_penalty):
        return logits
    logits = logits.clone()
    if bias is not None:
        row_idx, tok_idx, values = (_move(t, logits.device) for t in bias)
        logits.index_put_((row_idx, tok_idx), values, accumulate=True)
    if allowed_rows:
        _keep_allowed(logits, rows, allowed_rows)
    for bans in (banned, bad_words):
        if bans is not None:
            _ban(logits, *bans[:2])
    if uses_repetition:
        _apply_repetition_penalty(logits, rows)
    if uses_output_penalty:
        _apply_output_penalties(logits, rows)
    return logits


def _bias_entries(row: SamplingRow) -> dict[int, float]:
    return row.params.logit_bias or {}


def _keep_allowed(logits: torch.Tensor, rows: Sequence[SamplingRow], allowed_rows: Sequence[int]) -> None:
    """Every token outside a row's allowed_token_ids to -inf (rows whose allowed tokens are all
    -inf already, e.g. outside their grammar, are left as they were). Tensor ops only, so nothing
    here waits for the device."""
    vocab = logits.shape[1]
    for i in allowed_rows:
        ids = [t for t in rows[i].params.allowed_token_ids if 0 <= t < vocab]
        if not ids:
            continue
        allowed = _move(torch.tensor(ids, dtype=torch.long), logits.device)
        kept = logits[i, allowed]
        masked = torch.full_like(logits[i], float("-inf"))
        masked[allowed] = kept
        logits[i] = torch.where(torch.isfinite(kept).any(), masked, logits[i])


def _bad_word_entries(row: SamplingRow) -> dict[int, float]:
    """The last token of every bad word whose other tokens the row generated last."""
    sequences = row.params.bad_words_token_ids
    if not sequences:
        return {}
    tokens, generated = row.token_ids, row.num_output_tokens
    banned: dict[int, float] = {}
    for seq in sequences:
        before = len(seq) - 1
        if before <= generated and all(tokens[len(tokens) - before + j] == seq[j] for j in range(before)):
            banned[seq[-1]] = 0.0
    return banned


def _ban(logits: torch.Tensor, row_idx: torch.Tensor, tok_idx: torch.Tensor) -> None:
    """logits[row_idx, tok_idx] = -inf, except in rows this would leave with no finite logit (a
    grammar that may only end, under a min_tokens ban on its stop; an allowed token that is a bad
    word), which keep their logits. Tensor ops only, so nothing here waits for the device."""
    rows = _move(torch.unique(row_idx), logits.device)  # the indices are host tensors: no device sync
    row_idx, tok_idx = _move(row_idx, logits.device), _move(tok_idx, logits.device)
    before = logits[rows].clone()
    logits[row_idx, tok_idx] = float("-inf")
    after = logits[rows]
    emptied = ~torch.isfinite(after).any(dim=1) & torch.isfinite(before).any(dim=1)
    logits[rows] = torch.where(emptied.unsqueeze(1), before, after)


def _min_tokens_ban_entries(row: SamplingRow) -> dict[int, float]:
    params = row.params
    if not params.min_tokens or row.num_output_tokens >= params.min_tokens:
        return {}
    banned = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        banned.update(row.eos_token_ids)
    return dict.fromkeys(banned, 0.0)


def _sparse_entries(
    rows: Sequence[SamplingRow], vocab: int, entries_of
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Flattens per-row ``{token: value}`` dicts into (row, token, value) index tensors.

    Token ids outside the vocabulary are dropped: the engine rejects them at
    request time, and the sampler must not crash the batch for one bad row.
    """
    row_idx: list[int] = []
    tok_idx: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token, value in entries_of(row).items():
            if 0 <= token < vocab:
                row_idx.append(i)
                tok_idx.append(token)
                values.append(value)
    if not row_idx:
        return None
    return torch.tensor(row_idx), torch.tensor(tok_idx), torch.tensor(values, dtype=torch.float32)


def _token_counts(
    token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """How often each token occurs in each row's list; ``[rows, vocab]`` float32."""
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    lengths = [len(tokens) for tokens in token_lists]
    if sum(lengths) == 0:
        return counts
    ids = torch.cat([torch.as_tensor(list(tokens), dtype=torch.long) for tokens in token_lists])
    row_idx = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor(lengths))
    keep = (ids >= 0) & (ids < vocab)
    ids, row_idx = ids[keep].to(device), row_idx[keep].to(device)
    counts.index_put_((row_idx, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    return counts


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """HF/vLLM: a token seen in prompt or output has a positive logit divided by the
    penalty and a negative one multiplied by it (in place)."""
    vocab = logits.shape[1]
    seen = (
        _token_counts(
            [r.token_ids for r in rows],  # prompt and outputs alike
            vocab,
            logits.device,
        )
        > 0
    )
    penalty = on_device([r.params.repetition_penalty for r in rows], logits.device)
    penalty = penalty.unsqueeze(1).expand_as(logits)  # [rows, vocab]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    # A small penalty can push a positive logit past float32's range; +inf would make softmax NaN.
    penalised.clamp_(max=torch.finfo(logits.dtype).max)
    torch.where(seen, penalised, logits, out=logits)


def _apply_output_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """OpenAI: logit -= frequency * count + presence * (count > 0), over output tokens (in place)."""
    counts = _token_counts([r.output_token_ids for r in rows], logits.shape[1], logits.device)
    frequency = on_device([r.params.frequency_penalty for r in rows], logits.device)
    presence = on_device([r.params.presence_penalty for r in rows], logits.device)
    logits -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0).float()


# ---------------------------------------------------------------- choosing tokens


def _choose_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Argmax for greedy rows, a filtered random draw for the rest; ``[rows]`` int64."""
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    if len(greedy) == len(rows):
        return logits.argmax(dim=-1)
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if greedy:
        greedy_idx = on_device(greedy, logits.device)
        tokens[greedy_idx] = logits[greedy_idx].argmax(dim=-1)
    random = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    random_rows = [rows[i] for i in random]
    random_idx = on_device(random, logits.device)
    tokens[random_idx] = _sample(logits[random_idx], random_rows)
    return tokens


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row; ``logits`` is ``[rows, vocab]``."""
    device = logits.device
    temperature = on_device([r.params.temperature for r in rows], device)
    logits = logits / temperature.unsqueeze(1)
    top_k = [r.params.effective_top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    elif any(k > 0 for k in top_k):
        logits = _top_k_only(logits, top_k)
    probs = torch.softmax(logits, dim=-1)  # [rows, vocab]
    min_p = [r.params.min_p for r in rows]
    if any(p > 0.0 for p in min_p):
        probs = _min_p(probs, on_device(min_p, device))
    noise = _exponential_noise(rows, logits.shape[1], device)
    return (probs / noise).argmax(dim=-1)


def _k_per_row(top_k: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """top_k as a ``[rows, 1]`` tensor with 'disabled' (0) and k > vocab meaning all of it."""
    return on_device([vocab if k <= 0 else min(k, vocab) for k in top_k], device)[:, None]


def _top_k_only(logits: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """Masks every logit below each row's k-th largest (ties with it survive)."""
    vocab = logits.shape[1]
    k = _k_per_row(top_k, vocab, logits.device)
    largest = torch.topk(logits, int(k.max()), dim=-1).values  # [rows, max_k]
    threshold = largest.gather(1, k - 1)  # [rows, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """Keeps each row's k best tokens, then the smallest set of them whose mass reaches top_p."""
    vocab = logits.shape[1]
    k = _k_per_row(top_k, vocab, logits.device)  # [rows, 1]
    width = int(k.max())
    # A full sort of the vocabulary is the slow part; when every row has a top_k,
    # the best max(top_k) tokens are all that can survive.
    if width < vocab:
        sorted_logits, order = torch.topk(logits, width, dim=-1)  # both [rows, width]
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # both [rows, vocab]
    positions = torch.arange(width, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(positions >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # exclusive prefix sum
    # top_p = 1 keeps everything, even where rounding lets the prefix sum pass 1.
    p = on_device([q if q < 1.0 else float("inf") for q in top_p], logits.device)
    # The best token always survives: its mass_before is 0 and p > 0.
    sorted_logits = sorted_logits.masked_fill(mass_before >= p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zeroes tokens less likely than min_p times the row's best token; ``min_p`` is ``[rows]``."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def _exponential_noise(
    rows: Sequence[SamplingRow], vocab: int, device: torch.device
) -> torch.Tensor:
    """Exp(1) noise ``[rows, vocab]``: seeded rows from their own generator (``vocab``
    uniforms per step), the others from one draw of the default generator."""
    uniform = torch.empty(len(rows), vocab, dtype=torch.float32, device=device)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        uniform.uniform_()
    elif unseeded:
        idx = on_device(unseeded, device)
        uniform[idx] = torch.rand(len(unseeded), vocab, device=device)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniform[i].uniform_(generator=row.generator)
    # -log(U) is Exp(1); several times cheaper than Tensor.exponential_ on CPU.
    # U < 1 keeps the noise above 0; U = 0 gives inf noise, i.e. that token loses.
    return uniform.log_().neg_()


# ---------------------------------------------------------------- logprobs


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> SamplerOutput:
    """The chosen tokens' raw logprobs, plus ranks and top-k lists (or the asked tokens') when any row asked."""
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [rows, 1]
    wanted = [None if r.params.logprob_token_ids else r.params.logprobs for r in rows]  # top-k rows
    if all(r.params.num_logprobs is None for r in rows):
        return SamplerOutput(token_ids.tolist(), chosen.squeeze(1).tolist(), None, None)
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1  # [rows]
    top_lists: list[list[tuple[int, float]]] = [[] for _ in rows]
    top_ranks: list[list[int] | None] = [None for _ in rows]
    for i, r in enumerate(rows):
        if r.params.logprob_token_ids:  # these tokens, in the order asked, each with its rank
            ids = torch.tensor(r.params.logprob_token_ids, dtype=torch.int64, device=raw_logprobs.device)
            values = raw_logprobs[i, ids]
            token_ranks = (raw_logprobs[i].unsqueeze(0) > values.unsqueeze(1)).sum(dim=-1) + 1
            kept = [(t, v, k) for t, v, k in zip(r.params.logprob_token_ids, values.tolist(), token_ranks.tolist(),
                                                 strict=True) if v != float("-inf")]  # as below
            top_lists[i] = [(t, v) for t, v, _ in kept]
            top_ranks[i] = [k for _, _, k in kept]
    max_k = min(max(k or 0 for k in wanted), raw_logprobs.shape[1])
    if max_k > 0:
        values, ids = top_k_logprobs(raw_logprobs, max_k)
        values_list, ids_list = values.tolist(), ids.tolist()
        for i, k in enumerate(wanted):
            if k:
                # A token at -inf (a grammar forbids it) cannot be drawn: it is no alternative, and
                # JSON has no -inf to report it with.
                top_lists[i] = [(t, v) for t, v in zip(ids_list[i][:k], values_list[i][:k], strict=True)
                                if v != float("-inf")]
    return SamplerOutput(token_ids.tolist(), chosen.squeeze(1).tolist(), top_lists, ranks.tolist(), top_ranks)
