"""PFlash: speculative prefill. A cheap drafter reads a long prompt once, scores each token
by the attention the prompt's last tokens pay to it, and only the best-scored chunks (plus
the head, the tail, the question and the places it quotes) reach the target's prefill.

``select``: chunk selection on scores (no model); ``scorer``: the drafter's forward and
scores; ``compressor``: tokenizers, selection and the query-survival rule together;
``policy``: when and how much to compress (mode, threshold, curve, per-session bandit).
"""
