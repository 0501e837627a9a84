#!/usr/bin/env bash
# Sets up .venv (first run only) and runs the main job: an edge server plus simulated devices
# training on LFW. Arguments go to `splitface-research demo` (see --help), e.g. --data PATH; they come after the
# default release below, so they override it (`--release none --split conv1` is the paper's conv1 release).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
# The default release is the privacy frontier's best measured point (results/frontier/best.json; a test keeps
# the two equal). The audit measured what it leaks: the main job prints those figures.
DEFAULT_RELEASE=(--release dct --split layer2 --dct-drop 4 --mechanism per-image --clip-norm 12 --noise-multiplier 0.005 --frequency-gamma 2)
# How the server reads that release: the DCT replaces every device stage up to the cut, and the server's stage that
# stands in for them is a conv plus two residual blocks instead of the conv alone (server side only: the device and
# what it releases are the same). At test time the server also embeds the mirror image's release, which it computes
# from the release itself (the block DCT of a mirrored image is the blocks reversed with some signs flipped), and
# averages the two: test-time flipping, with nothing more released; it trains on that average too, so that its model
# learns the embedding it is tested on. Another --release drops the stage, and one without a mirror that the server
# can compute (a learned layer's output, e.g. conv1) drops the average (results/pretrain/, results/pretrain-hold/,
# results/pretrain-views/, docs/pretrain.md).
DEFAULT_SERVER_STAGE=(--dct-stem-blocks 2 --mirror-average --mirror-train)
# The wire: int8 with a scale per image and channel both ways, a quarter of float32's bytes at no measured accuracy
# cost (docs/wire.md); a function of the audited release, so the audit's figures bound what it leaks.
DEFAULT_WIRE=(--activation-encoding i8c --gradient-encoding i8c)
# The start: splitface's backbone distilled from dlib's public recognizer on public LFW faces (none of LFW-158's
# people, none of View 1's test pairs), matching the teacher on 16 views of each face for 150 epochs, then for 150
# more with the release above and its noise in the device part (noise-aware); built on first use (about 3.6 hours on
# 2 cores, with progress bars; resumable), then reused from ~/.cache/splitface (docs/pretrain.md). `--student-views 0
# --noise-aware-views 0 --student-epochs 60 --noise-aware-epochs 60` is the earlier start (about 80 minutes; LFW-158
# about 0.04 lower, results/pretrain-hold/). The server's classifier
# starts as its classes' mean embeddings over the first epoch (weight imprinting), while the rest of the server's
# model waits (it would otherwise chase a head that the means keep rewriting), then learns at 10x the rest's
# gentle rate, so that fine-tuning keeps what the start knows (results/pretrain/, results/pretrain-views/,
# results/pretrain-hold/). `--init scratch --head-lr-scale 1 --imprint-epochs 0 --lr 0.05 --dct-stem-blocks 0 --no-mirror-average` is
# the old start from seeded weights (nothing imprinted, so nothing held).
DEFAULT_START=(--init distilled --student-views 16 --noise-aware-views 16 --student-epochs 150 --noise-aware-epochs 150 --head-lr-scale 10 --imprint-epochs 1 --imprint-hold-tail --lr 0.01)
exec .venv/bin/python -m research demo "${DEFAULT_START[@]}" "${DEFAULT_RELEASE[@]}" "${DEFAULT_SERVER_STAGE[@]}" \
    "${DEFAULT_WIRE[@]}" "$@"
