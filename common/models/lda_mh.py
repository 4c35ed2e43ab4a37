"""Collapsed LDA and SentenceLDA by Metropolis–Hastings with alias tables (LightLDA-style), with
the iFTM party's differential-privacy perturbation (Jiang et al., "Industrial Federated Topic
Modeling", ACM TIST 2021).

A corpus is a flat array of word ids with document and sentence boundaries (:class:`Corpus`).
Each sweep visits every token (LDA) or every sentence (SentenceLDA: all words of a sentence
share one topic) and runs ``mh_steps`` rounds of two alternating Metropolis–Hastings proposals:

* the **doc proposal** q_d(k) ∝ ñ_dk + α, from a table built once per document and sweep
  (stale within the document, which MH allows since the acceptance uses the very table the
  draw came from): an alias table over the document's few nonzero ñ_dk mixed with the uniform
  α part, so that building it is not an alias build over all K;
* the **word proposal** q_w(k) ∝ (n_wk + β_wk) / (n_k + Σ_w β_wk), from one alias table per
  word built once per sweep (LightLDA's stale word tables). For a sentence, a word of the
  sentence is picked at random and its table used; the proposal is the mixture over the
  sentence's words, which is what the acceptance uses.

Both draws are O(1). A proposal t from state s is accepted with probability
min(1, p(t) q(s) / (p(s) q(t))), with the collapsed conditional p (the paper's eqs. 19 and 22
for LDA, 27–28 for SentenceLDA, where p(k) multiplies over the sentence's words).

Privacy (the interpretation implemented here). "The per-token sufficient statistics n_d·
are perturbed once with Laplace(1/ε) noise and clipped to zero at or below τ": at the start of
training, after the random initial assignment, every entry of the document–topic count matrix
n_dk (tokens of document d on topic k; sentences for SentenceLDA) receives one draw
η_dk ~ Laplace(0, 1/ε), kept for the whole of training. Wherever the sampler reads a document
count — the targets and the doc proposal — it reads the privatized count
ñ_dk = n_dk + η_dk, set to 0 when ≤ τ (:func:`common.privacy.laplace.privatize`), never n_dk itself.
The word–topic counts that leave the party get no noise of their own: they are tallied from
the party's tokens, and the upload (normalized with a known β) gives them back exactly, so ε
bounds what the document statistics say, not what is sent (docs/PRIVACY.md). ``epsilon=None``
switches the noise off (τ still clips).

The token loops are numba kernels compiled once (``cache=True``). The sweeps draw from a
splitmix64 generator whose state the kernels carry (:func:`rng_state`), the initial assignment
from numba's own generator (:func:`seed_numba`); both are seeded from ``random_state``, so a
fit is reproducible.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numba
import numpy as np
import scipy.sparse as sp

from common.data.text import bow_matrix
from common.privacy.laplace import laplace_noise

#: Name of the topic-word array the parties upload and the master publishes.
TOPICS = "topics"

__all__ = ["TOPICS", "Corpus", "LDAMH", "LDAParams", "build_alias", "alias_draw", "sample_alias",
           "rng_state", "heldout_log_likelihood", "corpus_from_texts", "corpus_from_bow",
           "split_sentences"]

_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+|\n+")


# ------------------------------------------------------------------------------------ corpus
@dataclass
class Corpus:
    """Tokens of a corpus as flat arrays.

    Attributes
    ----------
    words : numpy.ndarray of int32
        Word id of every token, documents one after the other, sentences within them.
    doc_ptr : numpy.ndarray of int64, shape (n_docs + 1,)
        Tokens of document d are ``words[doc_ptr[d]:doc_ptr[d + 1]]``.
    sent_ptr : numpy.ndarray of int64, shape (n_sentences + 1,)
        Token offsets of the sentences.
    doc_sent_ptr : numpy.ndarray of int64, shape (n_docs + 1,)
        Sentences of document d are ``doc_sent_ptr[d]:doc_sent_ptr[d + 1]``.
    n_words : int
        Vocabulary size V.
    """

    words: np.ndarray
    doc_ptr: np.ndarray
    sent_ptr: np.ndarray
    doc_sent_ptr: np.ndarray
    n_words: int

    @property
    def n_docs(self) -> int:
        return len(self.doc_ptr) - 1

    @property
    def n_tokens(self) -> int:
        return len(self.words)

    def subset(self, docs: np.ndarray) -> Corpus:
        """The corpus of documents ``docs`` (in that order)."""
        words, dptr, sptr, dsptr = [], [0], [0], [0]
        for d in np.asarray(docs):
            s0, s1 = self.doc_sent_ptr[d], self.doc_sent_ptr[d + 1]
            for s in range(s0, s1):
                a, b = self.sent_ptr[s], self.sent_ptr[s + 1]
                words.append(self.words[a:b])
                sptr.append(sptr[-1] + b - a)
            dptr.append(sptr[-1])
            dsptr.append(dsptr[-1] + s1 - s0)
        w = np.concatenate(words).astype(np.int32) if words else np.zeros(0, np.int32)
        return Corpus(w, np.asarray(dptr, np.int64), np.asarray(sptr, np.int64),
                      np.asarray(dsptr, np.int64), self.n_words)


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: split after ``. ! ? ;`` followed by white space, and at line
    breaks."""
    return [s for s in _SENTENCE_END.split(text) if s.strip()] or [text]


def corpus_from_bow(X: sp.spmatrix | np.ndarray, sentences_per_doc: np.ndarray | None = None
                    ) -> Corpus:
    """Tokens from a count matrix (rows = sentences if ``sentences_per_doc`` is given, else
    documents of one sentence each)."""
    X = sp.csr_matrix(X)
    counts = np.rint(X.data).astype(np.int64)
    cols = X.indices.astype(np.int32)
    words = np.repeat(cols, counts)
    sent_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)[X.indptr]
    if sentences_per_doc is None:
        sentences_per_doc = np.ones(X.shape[0], dtype=np.int64)
    doc_sent_ptr = np.concatenate([[0], np.cumsum(sentences_per_doc)]).astype(np.int64)
    doc_ptr = sent_ptr[doc_sent_ptr]
    return Corpus(words.astype(np.int32), doc_ptr, sent_ptr, doc_sent_ptr, X.shape[1])


def corpus_from_texts(texts: Sequence[str], vocabulary: Sequence[str]) -> Corpus:
    """Tokens of ``texts`` over ``vocabulary`` (:func:`common.data.text.bow_matrix`, sentence by
    sentence; words out of the vocabulary are dropped, and a sentence's word order with them,
    which bag-of-words models never use)."""
    sentences: list[str] = []
    per_doc = np.zeros(len(texts), dtype=np.int64)
    for i, t in enumerate(texts):
        parts = split_sentences(t)
        sentences += parts
        per_doc[i] = len(parts)
    return corpus_from_bow(bow_matrix(sentences, vocabulary), per_doc)


# ------------------------------------------------------------------------------------ kernels
@numba.njit(cache=True)
def seed_numba(seed: int) -> None:
    """Seed numba's generator (it is separate from NumPy's). The initial assignment and the
    fold-in draw from it; the sweeps use the generator of :func:`rng_state`."""
    np.random.seed(seed)


# splitmix64 (Steele, Lea & Flood 2014; passes BigCrush). The sweeps draw two uniforms per MH
# step, and numba's Mersenne twister costs ~22 ns a double on this CPU against ~4 ns here: it
# was most of a sweep's time. The 64-bit state lives in a one-element array the kernels carry.
_SM_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_SM_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_SM_MIX2 = np.uint64(0x94D049BB133111EB)
_TWO_M53 = 1.0 / 9007199254740992.0


def rng_state(seed: int) -> np.ndarray:
    """State of the sweeps' generator for ``seed``: a one-element uint64 array.

    Parameters
    ----------
    seed : int

    Returns
    -------
    numpy.ndarray of uint64, shape (1,)
    """
    return np.array([int(seed) % 2**64], dtype=np.uint64)


# hand-written: splitmix64 in numba: ~4 ns a double against ~22 ns for numba's Mersenne twister
@numba.njit(cache=True, inline="always")
def _uniform(state):
    """A uniform double in [0, 1) from the splitmix64 ``state`` (advanced in place)."""
    x = state[0] + _SM_GAMMA
    state[0] = x
    x = (x ^ (x >> np.uint64(30))) * _SM_MIX1
    x = (x ^ (x >> np.uint64(27))) * _SM_MIX2
    x = x ^ (x >> np.uint64(31))
    return np.float64(x >> np.uint64(11)) * _TWO_M53


# hand-written: Walker/Vose alias tables, allocation-free in numba; no library works there
@numba.njit(cache=True)
def _build_alias_n(weights, n, prob, alias, small, large) -> None:
    """Walker/Vose alias table of ``weights[:n]`` into ``prob[:n]`` and ``alias[:n]``, with
    the caller's int32 scratch ``small`` and ``large`` (no allocation: it runs per document
    and per word)."""
    total = 0.0
    for i in range(n):
        total += weights[i]
    ns = 0
    nl = 0
    for i in range(n):
        prob[i] = weights[i] * n / total
        alias[i] = i
        if prob[i] < 1.0:
            small[ns] = i
            ns += 1
        else:
            large[nl] = i
            nl += 1
    while ns > 0 and nl > 0:
        ns -= 1
        s = small[ns]
        g = large[nl - 1]
        alias[s] = g
        prob[g] = prob[g] + prob[s] - 1.0
        if prob[g] < 1.0:
            nl -= 1
            small[ns] = g
            ns += 1
    for i in range(nl):
        prob[large[i]] = 1.0
    for i in range(ns):  # rounding leftovers
        prob[small[i]] = 1.0


@numba.njit(cache=True)
def build_alias(weights: np.ndarray, prob: np.ndarray, alias: np.ndarray) -> None:
    """Walker/Vose alias table of the non-negative ``weights`` into ``prob`` and ``alias``."""
    k = weights.shape[0]
    _build_alias_n(weights, k, prob, alias, np.empty(k, dtype=np.int32),
                   np.empty(k, dtype=np.int32))


# hand-written: the O(1) alias draw the MH sweeps inline; part of the alias tables above
@numba.njit(cache=True, inline="always")
def _alias_pick(prob, alias, n, u):
    """The draw of an alias table of ``n`` entries for the uniform ``u`` in [0, 1)."""
    x = u * n
    i = min(int(x), n - 1)  # u * n can round up to n
    if x - i < prob[i]:
        return i
    return alias[i]


@numba.njit(cache=True, inline="always")
def alias_draw(prob: np.ndarray, alias: np.ndarray, state: np.ndarray) -> int:
    """One O(1) draw from an alias table, advancing the generator ``state``
    (:func:`rng_state`)."""
    return _alias_pick(prob, alias, prob.shape[0], _uniform(state))


@numba.njit(cache=True)
def _sample_alias(prob, alias, n, state, out) -> None:
    for i in range(n):
        out[i] = alias_draw(prob, alias, state)


def sample_alias(weights: np.ndarray, n: int, random_state: int = 0) -> np.ndarray:
    """``n`` draws from the distribution ∝ ``weights`` through an alias table (for tests)."""
    w = np.asarray(weights, dtype=np.float64)
    prob, alias = np.empty(len(w)), np.empty(len(w), dtype=np.int32)
    build_alias(w, prob, alias)
    out = np.empty(n, dtype=np.int64)
    _sample_alias(prob, alias, n, rng_state(random_state), out)
    return out


# hand-written: iFTM's privatized count (kept noise, clipped at tau), inline in the kernels
@numba.njit(cache=True, inline="always")
def _priv(count: float, noise: float, tau: float) -> float:
    v = count + noise
    return v if v > tau else 0.0


class _DocProposal(NamedTuple):
    """Scratch of the doc proposal, allocated once per sweep (K entries each)."""

    dq: np.ndarray      # ñ_dt + α, unnormalized: what the acceptance reads
    weight: np.ndarray  # ñ_dt of the nonzero entries
    topic: np.ndarray   # their topics (int32)
    prob: np.ndarray    # alias table over them
    alias: np.ndarray
    small: np.ndarray   # alias-build scratch (int32)
    large: np.ndarray


@numba.njit(cache=True)
def _doc_proposal_new(k):
    return _DocProposal(np.empty(k), np.empty(k), np.empty(k, dtype=np.int32), np.empty(k),
                        np.empty(k, dtype=np.int32), np.empty(k, dtype=np.int32),
                        np.empty(k, dtype=np.int32))


# hand-written: LightLDA's sparse doc proposal; no library offers it with privatized counts
@numba.njit(cache=True)
def _doc_proposal_build(dp, ndk, noise, d, tau, alpha):
    """Table of q_d(t) ∝ ñ_dt + α for document d, as the mixture of an alias table over the
    nonzero ñ_dt (few: a document touches few topics and τ clips most noise on the others)
    and the uniform α part. A document then costs O(K) arithmetic plus an alias build over its
    nonzero topics, not an alias build over all K. Returns (number of nonzero topics, their
    share of the mass), which :func:`_doc_proposal_draw` takes."""
    k = dp.dq.shape[0]
    nnz = 0
    mass = 0.0
    for t in range(k):
        v = _priv(ndk[d, t], noise[d, t], tau)
        dp.dq[t] = v + alpha
        if v > 0.0:
            dp.weight[nnz] = v
            dp.topic[nnz] = t
            nnz += 1
            mass += v
    if nnz > 0:
        _build_alias_n(dp.weight, nnz, dp.prob, dp.alias, dp.small, dp.large)
    return nnz, mass / (mass + k * alpha)


@numba.njit(cache=True, inline="always")
def _doc_proposal_draw(dp, nnz, share, u):
    """A draw of the doc proposal for the uniform ``u``: u < share picks the sparse part (and
    u / share is again uniform), the rest the uniform part."""
    if u < share:
        return dp.topic[_alias_pick(dp.prob, dp.alias, nnz, u / share)]
    k = dp.dq.shape[0]
    return min(int((u - share) / (1.0 - share) * k), k - 1)


@numba.njit(cache=True)
def _doc_proposal_draws(counts, noise, tau, alpha, n, random_state, out) -> None:
    """``n`` draws of the doc proposal of one document (for tests)."""
    dp = _doc_proposal_new(counts.shape[1])
    nnz, share = _doc_proposal_build(dp, counts, noise, 0, tau, alpha)
    state = np.empty(1, dtype=np.uint64)
    state[0] = random_state
    for i in range(n):
        out[i] = _doc_proposal_draw(dp, nnz, share, _uniform(state))


# hand-written: LightLDA's stale per-word alias tables with a per-word beta prior
@numba.njit(cache=True)
def _word_tables(nwk, nk, beta, beta_sum, wq, wprob, walias) -> None:
    n_words, k = nwk.shape
    small = np.empty(k, dtype=np.int32)
    large = np.empty(k, dtype=np.int32)
    inv = np.empty(k)
    for t in range(k):
        inv[t] = 1.0 / (nk[t] + beta_sum[t])
    for w in range(n_words):
        z = 0.0
        for t in range(k):
            wq[w, t] = (nwk[w, t] + beta[w, t]) * inv[t]
            z += wq[w, t]
        for t in range(k):
            wq[w, t] /= z  # normalized: the sentence proposal mixes words' tables
        _build_alias_n(wq[w], k, wprob[w], walias[w], small, large)


# hand-written: MH over privatized n_dk (iFTM); sklearn and gensim fit LDA variationally
@numba.njit(cache=True)
def _sweep_lda(words, doc_ptr, z, ndk, noise, nwk, nk, alpha, beta, beta_sum, tau, mh_steps,
               wq, wprob, walias, state) -> int:
    """One MH sweep over all tokens; returns the number of accepted moves."""
    k = nk.shape[0]
    _word_tables(nwk, nk, beta, beta_sum, wq, wprob, walias)
    dp = _doc_proposal_new(k)
    dq = dp.dq
    # 1 / (n_t + Σ_w β_wt), kept current on every move: no division per MH step
    inv = np.empty(k)
    for t in range(k):
        inv[t] = 1.0 / (nk[t] + beta_sum[t])
    accepted = 0
    for d in range(doc_ptr.shape[0] - 1):
        nnz, share = _doc_proposal_build(dp, ndk, noise, d, tau, alpha)
        for i in range(doc_ptr[d], doc_ptr[d + 1]):
            w = words[i]
            old = z[i]
            s = old
            # collapsed conditional p(t) with token i removed (its counts sit on ``old``);
            # p(old) is needed whenever the chain returns to it, so it is computed once
            p_old = ((_priv(ndk[d, old] - 1.0, noise[d, old], tau) + alpha)
                     * (nwk[w, old] - 1.0 + beta[w, old]) / (nk[old] - 1.0 + beta_sum[old]))
            ps = p_old
            for _ in range(mh_steps):
                for proposal in range(2):
                    u = _uniform(state)
                    if proposal == 0:
                        t = _doc_proposal_draw(dp, nnz, share, u)
                        qs = dq[s]
                        qt = dq[t]
                    else:
                        t = _alias_pick(wprob[w], walias[w], k, u)
                        qs = wq[w, s]
                        qt = wq[w, t]
                    if t == s:
                        continue
                    if t == old:
                        pt = p_old
                    else:
                        pt = ((_priv(ndk[d, t], noise[d, t], tau) + alpha)
                              * (nwk[w, t] + beta[w, t]) * inv[t])
                    if _uniform(state) * ps * qt < pt * qs:
                        s = t
                        ps = pt
            if s != old:
                accepted += 1
                ndk[d, old] -= 1
                nwk[w, old] -= 1
                nk[old] -= 1
                ndk[d, s] += 1
                nwk[w, s] += 1
                nk[s] += 1
                z[i] = s
                inv[old] = 1.0 / (nk[old] + beta_sum[old])
                inv[s] = 1.0 / (nk[s] + beta_sum[s])
    return accepted


# hand-written: repeat counts for SentenceLDA's conditional; no library has SentenceLDA
@numba.njit(cache=True)
def _sentence_repeats(words, sent_ptr, reps, tots) -> None:
    """For each token, the earlier occurrences of its word in its sentence (``reps``) and its
    total there (``tots``); they depend on the corpus only, so once per fit."""
    for si in range(sent_ptr.shape[0] - 1):
        a = sent_ptr[si]
        n = sent_ptr[si + 1] - a
        for j in range(n):
            r = 0
            c = 0
            for m in range(n):
                if words[a + m] == words[a + j]:
                    c += 1
                    if m < j:
                        r += 1
            reps[a + j] = r
            tots[a + j] = c


# hand-written: SentenceLDA's collapsed conditional (eqs. 27-28); no library has it
@numba.njit(cache=True)
def _sentence_logp(words, a, b, reps, tots, d, t, old, ndk, noise, nwk, nk, alpha, beta,
                   beta_sum, tau) -> float:
    """log p(sentence a:b on topic t | rest), the sentence's own counts removed from ``old``.

    The factors are multiplied and their log taken every 16 words, not one log per factor:
    16 factors stay within [1e-32, 1e144] for any count below 1e9, so neither product
    overflows nor underflows."""
    e = 1.0 if t == old else 0.0
    n = b - a
    base = nk[t] - e * n + beta_sum[t]
    lp = np.log(_priv(ndk[d, t] - e, noise[d, t], tau) + alpha)
    num = 1.0
    den = 1.0
    for j in range(n):
        w = words[a + j]
        num *= nwk[w, t] - e * tots[a + j] + beta[w, t] + reps[a + j]
        den *= base + j
        if (j & 15) == 15:
            lp += np.log(num / den)
            num = 1.0
            den = 1.0
    return lp + np.log(num / den)


# hand-written: SentenceLDA's MH sweep over privatized counts; no library has SentenceLDA
@numba.njit(cache=True)
def _sweep_sentence(words, sent_ptr, doc_sent_ptr, zs, ndk, noise, nwk, nk, alpha, beta,
                    beta_sum, tau, mh_steps, wq, wprob, walias, reps, tots, state) -> int:
    """One MH sweep over all sentences (one topic per sentence); accepted moves."""
    k = nk.shape[0]
    _word_tables(nwk, nk, beta, beta_sum, wq, wprob, walias)
    dp = _doc_proposal_new(k)
    dq = dp.dq
    accepted = 0
    for d in range(doc_sent_ptr.shape[0] - 1):
        nnz, share = _doc_proposal_build(dp, ndk, noise, d, tau, alpha)
        for si in range(doc_sent_ptr[d], doc_sent_ptr[d + 1]):
            a = sent_ptr[si]
            b = sent_ptr[si + 1]
            n = b - a
            if n == 0:
                continue
            old = zs[si]
            s = old
            lp_old = _sentence_logp(words, a, b, reps, tots, d, old, old, ndk, noise, nwk, nk,
                                    alpha, beta, beta_sum, tau)
            lps = lp_old
            for _ in range(mh_steps):
                for proposal in range(2):
                    if proposal == 0:
                        t = _doc_proposal_draw(dp, nnz, share, _uniform(state))
                        qs = dq[s]
                        qt = dq[t]
                    else:
                        w = words[a + min(int(_uniform(state) * n), n - 1)]
                        t = _alias_pick(wprob[w], walias[w], k, _uniform(state))
                        # the proposal is the mixture over the sentence's words
                        qs = 0.0
                        qt = 0.0
                        for j in range(a, b):
                            qs += wq[words[j], s]
                            qt += wq[words[j], t]
                    if t == s:
                        continue
                    if t == old:
                        lpt = lp_old
                    else:
                        lpt = _sentence_logp(words, a, b, reps, tots, d, t, old, ndk, noise,
                                             nwk, nk, alpha, beta, beta_sum, tau)
                    # accept with min(1, p(t) q(s) / (p(s) q(t))); exp overflow accepts
                    if _uniform(state) * qt < np.exp(lpt - lps) * qs:
                        s = t
                        lps = lpt
            if s != old:
                accepted += 1
                ndk[d, old] -= 1
                ndk[d, s] += 1
                nk[old] -= n
                nk[s] += n
                for j in range(a, b):
                    nwk[words[j], old] -= 1
                    nwk[words[j], s] += 1
                zs[si] = s
    return accepted


# hand-written: Gibbs fold-in with fixed topics, for Wallach et al.'s document completion
@numba.njit(cache=True)
def _fold_in(words, doc_ptr, phi_t, alpha, n_iter, burn_in, theta, doc_seeds) -> None:
    """Gibbs sampling of each document's topics with the topic–word matrix fixed
    (``phi_t``: V x K); ``theta`` gets the posterior mean of θ_d over the kept sweeps. With
    ``doc_seeds`` (one per document; empty: one stream for all), each document's draws start
    from its own seed."""
    k = phi_t.shape[1]
    p = np.empty(k)
    acc = np.empty(k)
    for d in range(doc_ptr.shape[0] - 1):
        if doc_seeds.shape[0] > 0:
            np.random.seed(doc_seeds[d])
        a = doc_ptr[d]
        b = doc_ptr[d + 1]
        n = b - a
        counts = np.zeros(k)
        acc[:] = 0.0
        z = np.empty(n, dtype=np.int64)
        for i in range(n):
            z[i] = int(np.random.random() * k)
            counts[z[i]] += 1
        kept = 0
        for it in range(n_iter):
            for i in range(n):
                w = words[a + i]
                counts[z[i]] -= 1
                total = 0.0
                for t in range(k):
                    total += (counts[t] + alpha) * phi_t[w, t]
                    p[t] = total
                u = np.random.random() * total
                t = 0
                while t < k - 1 and p[t] < u:
                    t += 1
                z[i] = t
                counts[t] += 1
            if it >= burn_in:
                kept += 1
                for t in range(k):
                    acc[t] += counts[t]
        for t in range(k):
            theta[d, t] = (acc[t] / max(kept, 1) + alpha) / (n + k * alpha)


# hand-written: initial assignment drawn from given topics (iFTM's prior); no library call
@numba.njit(cache=True)
def _init_from_prior(words, doc_ptr, sent_ptr, doc_sent_ptr, phi_t, sentence, z) -> None:
    """Initial assignment drawn from the topics' word probabilities (phi_t: V x K): each token
    (or, for SentenceLDA, each sentence by one of its words) takes t ∝ φ_t,w."""
    k = phi_t.shape[1]
    cum = np.empty(k)
    n_units = sent_ptr.shape[0] - 1 if sentence else words.shape[0]
    for i in range(n_units):
        if sentence:
            a = sent_ptr[i]
            b = sent_ptr[i + 1]
            if b == a:
                z[i] = int(np.random.random() * k)
                continue
            w = words[a + int(np.random.random() * (b - a))]
        else:
            w = words[i]
        total = 0.0
        for t in range(k):
            total += phi_t[w, t]
            cum[t] = total
        u = np.random.random() * total
        t = 0
        while t < k - 1 and cum[t] < u:
            t += 1
        z[i] = t


# ------------------------------------------------------------------------------------ model
# hand-written: no library samples (Sentence)LDA with iFTM's kept noise on n_dk and a prior
class LDAMH:
    """Collapsed LDA / SentenceLDA by alias-table Metropolis–Hastings, with the iFTM party's
    Laplace perturbation of the document–topic counts.

    Parameters
    ----------
    n_topics : int, default 20
        Topics K.
    alpha : float, default 0.1
        Symmetric Dirichlet prior of the document–topic distributions.
    beta : float, default 0.01
        Symmetric Dirichlet prior of the topic–word distributions.
    n_iter : int, default 50
        Sweeps per call of :meth:`fit`.
    mh_steps : int, default 2
        Rounds of the two alternating proposals (doc, word) per token or sentence and sweep.
    sentence : bool, default False
        SentenceLDA: all words of a sentence share one topic, and n_dk counts sentences.
    epsilon : float or None, default 11.0
        Privacy budget ε of the Laplace(1/ε) noise on n_dk (see the module docstring);
        None for no noise.
    tau : float, default 0.2
        Privatized counts at or below τ read as 0.
    prior_weight : float, default 1.0
        With a ``topic_prior`` in :meth:`fit`, the prior's pseudo-counts per topic, as a
        multiple of the average tokens per topic (N / K).
    warm_start : bool, default False
        A second :meth:`fit` on the same corpus continues from the current assignment (and
        the same noise: the counts are perturbed once) instead of starting afresh.
    random_state : int, default 0

    Attributes
    ----------
    components_ : numpy.ndarray of shape (n_topics, n_words)
        Word–topic counts n_kw (float64).
    topic_word_ : numpy.ndarray of shape (n_topics, n_words)
        Posterior-mean topics (n_kw + β_kw) / (n_k + Σ_w β_kw), rows summing to one.
    doc_topic_ : numpy.ndarray of shape (n_docs, n_topics)
        Document–topic counts n_dk of the training corpus (never privatized: local only).
    acceptance_ : float
        Fraction of tokens (sentences) whose topic changed in the last sweep.
    n_tokens_ : int
    """

    def __init__(self, n_topics: int = 20, alpha: float = 0.1, beta: float = 0.01,
                 n_iter: int = 50, mh_steps: int = 2, sentence: bool = False,
                 epsilon: float | None = 11.0, tau: float = 0.2, prior_weight: float = 1.0,
                 warm_start: bool = False, random_state: int = 0) -> None:
        self.n_topics = n_topics
        self.alpha = alpha
        self.beta = beta
        self.n_iter = n_iter
        self.mh_steps = mh_steps
        self.sentence = sentence
        self.epsilon = epsilon
        self.tau = tau
        self.prior_weight = prior_weight
        self.warm_start = warm_start
        self.random_state = random_state

    # -------------------------------------------------------------- fitting
    def _initialize(self, corpus: Corpus, rng: np.random.Generator,
                    phi_t: np.ndarray | None) -> None:
        k = self.n_topics
        n_units = len(corpus.sent_ptr) - 1 if self.sentence else corpus.n_tokens
        if phi_t is None:
            self.z_ = rng.integers(0, k, size=n_units).astype(np.int32)
        else:
            self.z_ = np.empty(n_units, dtype=np.int32)
            _init_from_prior(corpus.words, corpus.doc_ptr, corpus.sent_ptr,
                             corpus.doc_sent_ptr, phi_t, self.sentence, self.z_)
        self.nwk_ = np.zeros((corpus.n_words, k), dtype=np.int32)
        self.ndk_ = np.zeros((corpus.n_docs, k), dtype=np.int32)
        if self.sentence:
            sent_len = np.diff(corpus.sent_ptr)
            tok_z = np.repeat(self.z_, sent_len)
            sent_doc = np.repeat(np.arange(corpus.n_docs), np.diff(corpus.doc_sent_ptr))
            np.add.at(self.ndk_, (sent_doc, self.z_), 1)
        else:
            tok_z = self.z_
            tok_doc = np.repeat(np.arange(corpus.n_docs), np.diff(corpus.doc_ptr))
            np.add.at(self.ndk_, (tok_doc, tok_z), 1)
        np.add.at(self.nwk_, (corpus.words, tok_z), 1)
        self.nk_ = self.nwk_.sum(axis=0).astype(np.int64)
        # perturbed once, right after the initial assignment (see the module docstring)
        self.noise_ = (laplace_noise(self.ndk_.shape, self.epsilon, rng)
                       if self.epsilon is not None else np.zeros(self.ndk_.shape))

    def fit(self, corpus: Corpus, topic_prior: np.ndarray | None = None) -> LDAMH:
        """Run ``n_iter`` sweeps.

        Parameters
        ----------
        corpus : Corpus
        topic_prior : numpy.ndarray of shape (n_topics, n_words), optional
            Topics (rows summing to one) to learn from, e.g. an iFTM composed model: they
            enter the word–topic Dirichlet prior as pseudo-counts,
            β_kw = β + prior_weight · (N / K) · prior_kw, and, on a fresh start, the initial
            assignment is drawn from them.

        Returns
        -------
        self
        """
        k, v = self.n_topics, corpus.n_words
        rng = np.random.default_rng(self.random_state)
        seed = int(rng.integers(2**31 - 1))
        if hasattr(self, "fit_count_"):  # successive fits draw fresh streams
            seed = (seed + 7919 * self.fit_count_) % (2**31 - 1)
        seed_numba(seed)
        beta = np.full((v, k), self.beta, dtype=np.float64)
        phi_t = None
        if topic_prior is not None:
            topic_prior = np.asarray(topic_prior, dtype=np.float64)
            if topic_prior.shape != (k, v):
                raise ValueError(f"topic_prior has shape {topic_prior.shape}, "
                                 f"expected {(k, v)}")
            phi_t = np.ascontiguousarray(topic_prior.T)
            beta += self.prior_weight * corpus.n_tokens / k * phi_t
        fresh = not (self.warm_start and hasattr(self, "z_")
                     and self.nwk_.shape == (v, k) and self.ndk_.shape[0] == corpus.n_docs)
        if fresh:
            self._initialize(corpus, rng, phi_t)
            self.fit_count_ = 0
        self.fit_count_ += 1
        beta_sum = beta.sum(axis=0)
        wq = np.empty((v, k))
        wprob = np.empty((v, k))
        walias = np.empty((v, k), dtype=np.int32)
        tau = float(self.tau)
        state = rng_state(seed)
        if self.sentence:
            reps = np.empty(corpus.n_tokens, dtype=np.int32)
            tots = np.empty(corpus.n_tokens, dtype=np.int32)
            _sentence_repeats(corpus.words, corpus.sent_ptr, reps, tots)
        accepted = 0
        for _ in range(self.n_iter):
            if self.sentence:
                accepted = _sweep_sentence(corpus.words, corpus.sent_ptr, corpus.doc_sent_ptr,
                                           self.z_, self.ndk_, self.noise_, self.nwk_,
                                           self.nk_, float(self.alpha), beta, beta_sum, tau,
                                           self.mh_steps, wq, wprob, walias, reps, tots, state)
            else:
                accepted = _sweep_lda(corpus.words, corpus.doc_ptr, self.z_, self.ndk_,
                                      self.noise_, self.nwk_, self.nk_, float(self.alpha),
                                      beta, beta_sum, tau, self.mh_steps, wq, wprob, walias,
                                      state)
        self.acceptance_ = accepted / max(len(self.z_), 1)
        self.n_tokens_ = corpus.n_tokens
        self._beta = beta
        return self

    # -------------------------------------------------------------- between rounds
    _FITTED = ("z_", "nwk_", "ndk_", "nk_", "noise_", "fit_count_", "_beta", "acceptance_",
               "n_tokens_")

    def local_state(self) -> dict[str, Any]:
        """What :meth:`fit` leaves for the next call (the assignments and counts a warm start
        continues from, the Laplace noise drawn once, the fit count that picks the next
        sampling stream), as a state tree (:mod:`common.state`); empty before the first fit."""
        return {name: getattr(self, name) for name in self._FITTED if hasattr(self, name)}

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`local_state` returned."""
        for name in self._FITTED:
            if name in state:
                setattr(self, name, state[name])
            elif hasattr(self, name):
                delattr(self, name)

    # -------------------------------------------------------------- results
    @property
    def components_(self) -> np.ndarray:
        return self.nwk_.T.astype(np.float64)

    @property
    def doc_topic_(self) -> np.ndarray:
        return self.ndk_

    @property
    def topic_word_(self) -> np.ndarray:
        smoothed = self.nwk_.T + self._beta.T
        return smoothed / smoothed.sum(axis=1, keepdims=True)

    def transform(self, corpus: Corpus, n_iter: int = 30) -> np.ndarray:
        """Document–topic distributions θ of ``corpus`` with the topics fixed (Gibbs
        fold-in); shape (n_docs, n_topics), rows summing to one."""
        return fold_in(self.topic_word_, corpus, self.alpha, n_iter, self.random_state,
                       per_document=True)

    def get_topics(self, vocab: Sequence[str], n: int = 10) -> list[list[str]]:
        """Each topic's ``n`` most probable words."""
        from common.eval.topics import top_words
        return top_words(self.components_, vocab, n)


def fold_in(topic_word: np.ndarray, corpus: Corpus, alpha: float = 0.1, n_iter: int = 30,
            random_state: int = 0, per_document: bool = False) -> np.ndarray:
    """θ of each document of ``corpus`` under fixed topics ``topic_word`` (K x V, rows summing
    to one): Gibbs sampling of the tokens' topics, posterior mean over the second half of
    ``n_iter`` sweeps.

    With ``per_document``, each document's draws are seeded by ``random_state`` and its own
    words, so that a document gets the same θ whatever else is in the batch, and in whatever
    order (a model's ``transform``); otherwise one stream runs through the corpus (evaluation,
    as it has always been scored)."""
    phi_t = np.ascontiguousarray(np.asarray(topic_word, dtype=np.float64).T)
    theta = np.zeros((corpus.n_docs, phi_t.shape[1]))
    seed_numba(int(random_state))
    words = np.ascontiguousarray(corpus.words, dtype=np.int64)
    ptr = corpus.doc_ptr
    seeds = (np.array([zlib.crc32(words[ptr[d]:ptr[d + 1]].tobytes(),
                                  int(random_state) & 0xFFFFFFFF) for d in range(corpus.n_docs)],
                      dtype=np.int64)
             if per_document else np.empty(0, dtype=np.int64))
    _fold_in(corpus.words, corpus.doc_ptr, phi_t, float(alpha), int(n_iter), int(n_iter) // 2,
             theta, seeds)
    return theta


# hand-written: Wallach et al.'s document completion; gensim, sklearn give variational bounds
def heldout_log_likelihood(topic_word: np.ndarray, corpus: Corpus, alpha: float = 0.1,
                           n_iter: int = 30, random_state: int = 0) -> dict[str, float]:
    """Document-completion estimate of the held-out log-likelihood (Wallach et al. 2009).

    Every test document's tokens are split alternately into an observed half and a held-out
    half; θ_d is inferred from the observed half by Gibbs fold-in with the topics fixed, and
    the held-out half is scored as Σ_i log Σ_k θ_dk φ_k,w_i. Documents of fewer than two
    tokens are skipped. The same token-level estimator scores LDA and SentenceLDA topics.

    Parameters
    ----------
    topic_word : numpy.ndarray of shape (n_topics, n_words)
        Topics, rows summing to one and strictly positive (smoothed).
    corpus : Corpus
    alpha : float, default 0.1
    n_iter : int, default 30
        Fold-in sweeps (the second half averaged).
    random_state : int, default 0

    Returns
    -------
    dict
        ``loglik`` (total over held-out tokens), ``n_tokens``, ``loglik_per_token`` and
        ``perplexity`` = exp(-loglik / n_tokens).
    """
    phi = np.asarray(topic_word, dtype=np.float64)
    obs_words, obs_ptr, held, held_doc = [], [0], [], []
    for d in range(corpus.n_docs):
        toks = corpus.words[corpus.doc_ptr[d]:corpus.doc_ptr[d + 1]]
        if len(toks) < 2:
            continue
        obs_words.append(toks[0::2])
        obs_ptr.append(obs_ptr[-1] + len(toks[0::2]))
        held.append(toks[1::2])
        held_doc.append(np.full(len(toks[1::2]), len(obs_ptr) - 2))
    if not held:
        return {"loglik": 0.0, "n_tokens": 0, "loglik_per_token": float("nan"),
                "perplexity": float("nan")}
    observed = Corpus(np.concatenate(obs_words).astype(np.int32),
                      np.asarray(obs_ptr, np.int64), np.asarray(obs_ptr, np.int64),
                      np.arange(len(obs_ptr), dtype=np.int64), corpus.n_words)
    theta = fold_in(phi, observed, alpha, n_iter, random_state)
    w = np.concatenate(held)
    d = np.concatenate(held_doc)
    prob = np.einsum("ik,ik->i", theta[d], phi[:, w].T)
    ll = float(np.log(np.maximum(prob, 1e-300)).sum())
    n = len(w)
    return {"loglik": ll, "n_tokens": n, "loglik_per_token": ll / n,
            "perplexity": float(np.exp(-ll / n))}


# ------------------------------------------------------------------------------------ params
@dataclass
class LDAParams:
    """Hyperparameters of the ``lda`` and ``sentencelda`` families (cluster.yaml ``model``).

    Parameters
    ----------
    n_topics : int, default 20
        Topics of each party's local model.
    topics_per_worker : list of int, default []
        Per-party topic numbers, in sorted worker-id order (parties may differ); overrides
        ``n_topics`` where given.
    alpha : float, default 0.1
    beta : float, default 0.01
    sweeps : int, default 10
        MH sweeps per round (each round starts from the party's previous state).
    mh_steps : int, default 2
    epsilon : float, default 11.0
        Laplace budget ε; 0 switches the noise off.
    tau : float, default 0.2
        Clipping threshold τ of the privatized counts.
    prior_weight : float, default 1.0
        Weight of the received composed model as a word–topic prior (see ``LDAMH.fit``).
    xi : float, default 0.3
        Merge / compose threshold ξ on the weighted Jaccard similarity.
    top_l : int, default 20
        Top words per topic the similarity looks at.
    vocab_size : int, default 5000
    min_df : int, default 2
    eval_iter : int, default 30
        Fold-in sweeps of the held-out estimator.
    """

    n_topics: int = 20
    topics_per_worker: list = field(default_factory=list)
    alpha: float = 0.1
    beta: float = 0.01
    sweeps: int = 10
    mh_steps: int = 2
    epsilon: float = 11.0
    tau: float = 0.2
    prior_weight: float = 1.0
    xi: float = 0.3
    top_l: int = 20
    vocab_size: int = 5000
    min_df: int = 2
    eval_iter: int = 30

    def __post_init__(self) -> None:
        for name in ("n_topics", "sweeps", "mh_steps", "top_l", "vocab_size", "min_df",
                     "eval_iter"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1")
        if not isinstance(self.topics_per_worker, list) or not all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 2
                for k in self.topics_per_worker):
            raise ValueError("topics_per_worker: expected a list of integers >= 2")
        for name in ("alpha", "beta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a number > 0")
        if self.epsilon < 0 or self.tau < 0 or self.prior_weight < 0:
            raise ValueError("epsilon, tau, prior_weight: expected numbers >= 0")
        if not 0 <= self.xi <= 1:
            raise ValueError("xi: expected a number in [0, 1]")

    def model(self, n_topics: int, sentence: bool, random_state: int = 0,
              n_iter: int | None = None, warm_start: bool = True) -> LDAMH:
        """A party's sampler with these hyperparameters."""
        return LDAMH(n_topics=n_topics, alpha=self.alpha, beta=self.beta,
                     n_iter=self.sweeps if n_iter is None else n_iter, mh_steps=self.mh_steps,
                     sentence=sentence, epsilon=self.epsilon or None, tau=self.tau,
                     prior_weight=self.prior_weight, warm_start=warm_start,
                     random_state=random_state)
