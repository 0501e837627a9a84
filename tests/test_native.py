"""The native device runner (splitface/device/runtimes/native): built with CMake against the executorch wheel's
C++ runtime, it links no libtorch, and its release and summed weight gradient over chunks of batch-1 and
batch-2 programs, and over the strips of each image with the strip programs, equal eager PyTorch. The noise
it draws is ChaCha8's keystream (checked against `fastnoise.chacha_words`, itself checked against the
`cryptography` package's ChaCha20 and published ChaCha8 vectors) through Box-Muller, Gaussian, and under a fresh
key per release unless a key file is given. Bad inputs stop it with a message naming the
file. Without cmake or a C++ compiler the build fails with a message (it is not skipped). The same runner
cross-built for arm64 (against ExecuTorch's aarch64 wheel, which scripts/setup_arm64.sh unpacks) passes every one of
these runner tests under qemu-user, and its JNI library exports what the host's does.

The `native` backend (splitface/device/runtimes/native_runtime.py): one runner process serves a device's releases
and weight gradients, each step's weights read at run time, equal to eager PyTorch over steps whose weights
change and batches that shrink; layers and exports the strip programs do not cover are refused before
anything is built. (Training through it against a real server: tests/test_runtimes.py.)

The exact option in the runner (`--noise-discrete`, discrete_gaussian.h): its uniform integers equal
`NoiseStream.uniform_below`'s word for word, its samples follow `DiscreteGaussian`'s pmf, and a strip
release is the Python clip-and-quantise of eager PyTorch's release plus those samples, as int8. Through the
`native` backend (`--noise discrete`) it runs under the engine's per-release key: a replay repeats its integers,
the weight step and the accountant's figures are eager PyTorch's, and a simulator run spends what eager spends."""
from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from splitface.common.models import build_device_part, resolve_spec
from splitface.common.models.lrn import PaperLRN
from splitface.device.runtimes import native as native_module
from splitface.device.privacy.discrete import (DiscreteGaussian, DiscreteGaussianMechanism, clip_quantise, squared_norms)
from splitface.device.privacy.fastnoise import NoiseStream
from splitface.device.runtimes.native import (StripServer, build, build_cached, draw_integers, elf_machine,
                                              reference_normals, run_native, write_inputs)
from splitface.device.runtimes.native_runtime import NativeRuntime
from splitface.device.runtimes.manifest import RELEASE_GEMM_PTE, VJP_GEMM_PTE, Manifest
from splitface.export.artifacts import (example_inputs, export_gemm_ptes, export_strip_ptes, lower_to_xnnpack,
                                       manifest_of)
from splitface.export.gemm_programs import (GemmReleaseProgram, GemmWeightGrad, conv_grad, strip_constants,
                                            strip_example)
from splitface.device.runtimes.parity import GRAD_RTOL, RELEASE_ATOL, reference
from splitface.export.exporter import EXPORTER

SAMPLES, SIZE, ROWS = 4, 24, 4
# Strip heights against the noise stream's groups of 256 values (a plane of 24 px is 576 values, and the planes
# after the first start inside a group): ROWS = 4 rows (96 values) never hold a whole group and can end inside the
# group that their plane starts in; 12 rows (288) hold whole groups.
OTHER_ROWS = (12,)
STRIP_RELEASE, STRIP_GRAD = ["images", "weight", "bias"], ["images", "grad", "weight", "bias"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A device layer (DP clamp on) and its im2col programs for batches 1 and 2 and its strip programs."""
    root = tmp_path_factory.mktemp("programs")
    torch.manual_seed(0)
    layer = build_device_part(resolve_spec("iresnet_small"), "conv1").eval()
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = 1.0
    programs = {}
    for batch in (1, 2):
        images = torch.rand(batch, 3, SIZE, SIZE)
        with torch.no_grad():
            noise = torch.zeros_like(layer(images))
        release, vjp = export_gemm_ptes(layer, images, noise, None)
        programs[batch] = root / f"b{batch}"
        programs[batch].mkdir()
        (programs[batch] / RELEASE_GEMM_PTE).write_bytes(release)
        (programs[batch] / VJP_GEMM_PTE).write_bytes(vjp)
    for name, rows in (("strips", ROWS), *((f"strips{r}", r) for r in OTHER_ROWS)):
        programs[name] = root / name
        programs[name].mkdir()
        release, vjp = export_strip_ptes(layer, rows, SIZE)
        (programs[name] / "release.pte").write_bytes(release)
        (programs[name] / "vjp.pte").write_bytes(vjp)
    return layer, programs


@pytest.fixture(scope="module")
def builds() -> Callable[[str], Path]:
    """The runner (and libsplitface_jni beside it) for "host", built for this machine, or for "arm64",
    cross-built against the aarch64 wheel's runtime: each brought up to date on first use, in the per-user cache
    that the simulator and the Android core's tests build into too (a build is 20 s of the suite's two cores)."""
    @functools.cache
    def built(target: str) -> Path:
        return build_cached(arm64=target == "arm64")
    return built


@pytest.fixture(scope="module", params=["host", "arm64"])
def native(request, builds, exported, tmp_path_factory):
    """One build with the programs; the arm64 one runs under qemu-user (`launcher`): every test below holds both
    builds to the same programs and references."""
    return builds(request.param), *exported, tmp_path_factory.mktemp(f"native-{request.param}")


def linked_libraries(binary: Path) -> str:
    """The shared libraries `binary` loads: all of them, as ldd resolves them, for this machine's build; those it
    names (readelf, which reads either architecture) for the arm64 build."""
    arm64 = elf_machine(binary) == native_module.EM_AARCH64
    cmd = ["readelf", "-d", str(binary)] if arm64 else ["ldd", str(binary)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def strip_run(native, work, noise_std=None, key=None, grad=True, strips="strips"):
    """The strip programs (`strips`: of ROWS rows, or f"strips{r}" of r in OTHER_ROWS) through the runner, once,
    on the inputs in `work`."""
    binary, _, programs, _ = native
    return run_native(binary, work, SAMPLES, (programs[strips] / "release.pte", STRIP_RELEASE),
                      (programs[strips] / "vjp.pte", STRIP_GRAD) if grad else None, runs=1, warmup=0,
                      strips=True, noise_std=noise_std, noise_key=key)


def test_build_without_cmake_fails_with_a_message(monkeypatch, tmp_path):
    monkeypatch.setattr(native_module.shutil, "which", lambda tool: None)
    with pytest.raises(RuntimeError, match="needs cmake and c\\+\\+ on PATH"):
        build(tmp_path)


@pytest.mark.slow  # brings the cached runner up to date (CMake) and lowers the programs
def test_native_runner_matches_eager_in_chunks_without_libtorch(native):
    binary, layer, programs, root = native
    linked = linked_libraries(binary)
    assert "libexecutorch.so" in linked and "xnnpack" in linked and "torch" not in linked.replace("executorch", "")
    g = torch.Generator().manual_seed(1)
    images = 3 * torch.rand(SAMPLES, 3, SIZE, SIZE, generator=g)  # above the clamp: its mask matters
    shape = layer(images[:1]).shape[1:]
    noise, grad = 0.1 * torch.randn((SAMPLES, *shape), generator=g), torch.randn((SAMPLES, *shape), generator=g)
    weights = [p.detach() + 0.05 * torch.randn(p.shape, generator=g) for p in layer.parameters()]  # not the exported ones
    want_release, want_grads = reference(layer, images, noise, grad, weights)
    work = root / "io"
    write_inputs(work, {"images": images.numpy(), "noise": noise.numpy(), "grad": grad.numpy(),
                        "weight": weights[0].numpy(), "bias": weights[1].numpy()})
    for batch, program in ((b, programs[b]) for b in (1, 2)):
        report = run_native(binary, work, SAMPLES, (program / RELEASE_GEMM_PTE, ["images", "noise", "weight", "bias"]),
                            (program / VJP_GEMM_PTE, ["images", "grad", "weight", "bias"]), runs=1, warmup=0)
        assert report["program_batch"] == batch and report["grad_outputs"] == 2
        assert np.abs(report["release"] - want_release.numpy().ravel()).max() <= RELEASE_ATOL
        for got, want in zip(report["grads"], want_grads, strict=True):
            assert np.abs(got - want.numpy().ravel()).max() <= GRAD_RTOL * want.abs().max().item()
        assert 0 < report["rss_loaded_kb"] <= report["peak_forward_kb"] <= report["peak_kb"]
        assert len(report["forward_compute_ms"]) == 1 and report["forward_compute_ms"][0] > 0


@pytest.mark.slow
def test_native_runner_refuses_bad_inputs_by_name(native):
    binary, _, programs, root = native
    work = root / "bad"
    write_inputs(work, {"images": np.zeros((3, 3, SIZE, SIZE)), "noise": np.zeros(5), "weight": np.zeros(5),
                        "bias": np.zeros(5)})
    release = (programs[1] / RELEASE_GEMM_PTE, ["images", "noise", "weight", "bias"])
    with pytest.raises(RuntimeError, match=r"noise.f32 holds 20 bytes"):
        run_native(binary, work, 3, release, runs=1, warmup=0)
    with pytest.raises(RuntimeError, match="takes 4 inputs; 3 named"):
        run_native(binary, work, 3, (release[0], ["images", "noise", "weight"]), runs=1, warmup=0)
    with pytest.raises(RuntimeError, match="cannot open .*missing.f32"):
        run_native(binary, work, 3, (release[0], ["images", "missing", "weight", "bias"]), runs=1, warmup=0)


@pytest.mark.slow
def test_strip_runner_with_drawn_noise_matches_eager(native):
    """Strips of 4 rows of 24 px images (6 per image): the release with the noise the runner drew under a known
    key, and the weight gradient summed over strips and samples, equal eager PyTorch with that noise."""
    _, layer, _, root = native
    g = torch.Generator().manual_seed(4)
    images = 3 * torch.rand(SAMPLES, 3, SIZE, SIZE, generator=g)
    shape = layer(images[:1]).shape[1:]
    grad = torch.randn((SAMPLES, *shape), generator=g)
    weights = [p.detach() + 0.05 * torch.randn(p.shape, generator=g) for p in layer.parameters()]
    key = bytes(range(32))  # a test key; production draws a fresh one per release
    (root / "test.key").write_bytes(key)
    noise = 0.1 * torch.from_numpy(reference_normals(key, SAMPLES * shape.numel())).float().reshape(SAMPLES, *shape)
    want_release, want_grads = reference(layer, images, noise, grad, weights)
    work = root / "strip-io"
    write_inputs(work, {"images": images.numpy(), "grad": grad.numpy(), "weight": weights[0].numpy(),
                        "bias": weights[1].numpy()})
    report = strip_run(native, work, 0.1, root / "test.key")
    assert report["strip_rows"] == ROWS and report["noise_std"] == pytest.approx(0.1)
    assert np.abs(report["release"] - want_release.numpy().ravel()).max() <= RELEASE_ATOL
    for got, want in zip(report["grads"], want_grads, strict=True):
        assert np.abs(got - want.numpy().ravel()).max() <= GRAD_RTOL * want.abs().max().item()
    assert report["peak_kb"] > 0 and report["forward_noise_ms"][0] > 0
    for rows in OTHER_ROWS:  # the same noise, whichever way the strips cut its groups
        other = strip_run(native, work, 0.1, root / "test.key", grad=False, strips=f"strips{rows}")
        assert np.abs(other["release"] - want_release.numpy().ravel()).max() <= RELEASE_ATOL
    # without --noise-std nothing is drawn: the release is the layer's output
    plain = strip_run(native, work, grad=False)
    noiseless = reference(layer, images, torch.zeros_like(noise), grad, weights, grads=False)[0]
    assert np.abs(plain["release"] - noiseless.numpy().ravel()).max() <= RELEASE_ATOL


@pytest.mark.slow
def test_native_noise_is_keyed_chacha8_box_muller_and_fresh_per_release(native):
    """Zero weights make the release the noise itself: sigma z with z the key's normals, equal to the float64
    reference from the numpy ChaCha8 keystream (`fastnoise.chacha_words`), distributed as N(0, 1); without a key file every
    release draws a fresh key, so two releases of the same images share no noise."""
    _, layer, _, root = native
    work = root / "noise-io"
    images = torch.rand(SAMPLES, 3, SIZE, SIZE)
    weight, bias = (np.zeros(tuple(p.shape)) for p in layer.parameters())
    write_inputs(work, {"images": images.numpy(), "weight": weight, "bias": bias})
    key = bytes(range(100, 132))
    (root / "noise.key").write_bytes(key)
    z = strip_run(native, work, 1.0, root / "noise.key", grad=False)["release"]
    assert z.size == SAMPLES * weight.shape[0] * SIZE * SIZE
    assert np.abs(z - reference_normals(key, z.size)).max() < 2e-5
    for rows in OTHER_ROWS:  # the same normals, whichever way the strips cut the stream's groups
        assert np.array_equal(strip_run(native, work, 1.0, root / "noise.key", grad=False,
                                        strips=f"strips{rows}")["release"], z)
    n = z.size  # 36,864 values
    assert abs(z.mean()) < 5 / np.sqrt(n) and abs(z.std() - 1) < 0.01
    assert abs((np.abs(z) < 1).mean() - 0.6827) < 0.006 and abs((np.abs(z) < 2).mean() - 0.9545) < 0.004
    assert np.abs(z).max() <= np.sqrt(2 * np.log(2.0**24)) + 1e-4  # the 24-bit uniform's truncation
    a, b = (strip_run(native, work, 1.0, grad=False)["release"] for _ in range(2))
    assert (a == b).sum() < 10 and (a == z).sum() < 10  # fresh getrandom keys: independent draws
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.03


@pytest.mark.slow  # six small g++ builds
def test_every_vector_path_draws_the_reference_normals(tmp_path):
    """The noise generator's lane width differs per ISA (16 AVX-512, 8 AVX2, 4 SSE2; chacha_lanes.h) and the
    multiversioned build picks one at load time: every path this CPU can run, the old 16-lane ones included,
    gives the key's normals, equal to the float64 reference from the numpy ChaCha8 keystream (within
    the float32 polynomials' error, as the runner's own test), and the paths differ from each other by at most
    that much (baseline x86-64 has no FMA, so its roundings may differ in the last bits)."""
    from bench import noise_isa
    paths = noise_isa.runnable(noise_isa.cpu()["isa"])
    assert [p[0] for p in paths][-1] == "shipped build (multiversions)" and len(paths) >= 3
    for i, (label, march, width, _) in enumerate(paths):
        binary = noise_isa.build(march, width, tmp_path / f"noise-{i}")
        check_noise_dump(noise_isa, binary, tmp_path / f"z-{i}", label)


@pytest.mark.slow  # a cross build and a run under qemu-user
def test_arm64_noise_is_neon_and_draws_the_reference_normals_under_qemu(tmp_path):
    """The same sources built for arm64 by Debian's cross compiler (scripts/setup_arm64.sh installs it and qemu-user)
    compile to NEON (4 lanes: chacha_lanes.h) and, run under qemu-aarch64, draw the key's normals and
    keystream as on x86 (the whole runner's arm64 build: the `native` fixture's second parameter)."""
    from bench import noise_isa
    binary = noise_isa.build(None, None, tmp_path / "noise-arm64", cxx=noise_isa.ARM64_CXX)
    assert elf_machine(binary) == native_module.EM_AARCH64
    asm = subprocess.run([noise_isa.ARM64_CXX, *noise_isa.FLAGS, "-S", "-o", "-",
                          str(noise_isa.NATIVE / "gaussian_noise.cpp")], capture_output=True, text=True, check=True)
    assert asm.stdout.count(".4s") > 100  # the lanes as NEON vectors of 4 x 32 bits, not scalar code
    check_noise_dump(noise_isa, binary, tmp_path / "z", "arm64")


@pytest.mark.slow  # five small g++ builds (one of them for arm64), each run once (the arm64 one under qemu-user)
def test_every_vector_path_computes_the_same_lrn_bits_as_eager(tmp_path):
    """The runner's LRN and its backward (lrn.cpp) are multiversioned per ISA like the noise (isa_versions.h),
    and the runner's own tests run only the version this CPU picks. Built alone for every path this CPU can run
    (AVX-512, AVX2, the baseline, and the shipped multiversions) and for arm64 (NEON, under qemu-user), with the
    options CMake gives lrn.cpp, on one strip: every path gives the same bits, forward and backward. The steps
    are elementwise IEEE operations (products, sums in one window order, correctly rounded sqrt and division),
    uncontracted (-ffp-contract=off), so a vector width cannot change a result; without that option the AVX2 and
    AVX-512 versions fuse multiplies into adds and differ from the baseline in the last bits. And they are
    PaperLRN's forward and `conv_grad`. 16 channels (the real layer's) put every channel-window edge case in;
    805 pixels per channel are three of the forward's blocks of 256 and a part of one, and no multiple of any
    vector width."""
    from bench import lrn_isa
    from bench.machine import cpu
    layer = vgg_layer()
    real = strip_constants(layer)
    assert real == {"lrn_size": 5, "lrn_alpha": 1.0, "lrn_gamma": 2.0, "lrn_input_max": 1.0}  # the paper's, DP clamp
    channels = next(m for m in layer.modules() if isinstance(m, PaperLRN)).channels
    g = torch.Generator().manual_seed(7)
    shape = (1, channels, 23, 35)
    x, grad = 1.5 * torch.randn(shape, generator=g), torch.randn(shape, generator=g)  # x above the clamp, below 0
    x[0, :, 0, :5] = 0.0   # the ReLU mask's edge, and pixels whose whole window is zero
    x[0, :, 1, :5] = 1.0   # the clamp's edge (x <= m keeps the gradient)
    paths = lrn_isa.runnable(cpu()["isa"])
    assert [p[0] for p in paths][-1] == "shipped build (multiversions)" and len(paths) >= 2
    binaries = {label: lrn_isa.build(march, width, tmp_path / f"lrn-{i}")
                for i, (label, march, width, _) in enumerate(paths)}
    binaries["arm64"] = lrn_isa.build(None, None, tmp_path / "lrn-arm64", cxx=lrn_isa.ARM64_CXX)
    assert elf_machine(binaries["arm64"]) == native_module.EM_AARCH64
    asm = subprocess.run([lrn_isa.ARM64_CXX, *lrn_isa.compile_options(), "-S", "-o", "-",
                          str(lrn_isa.NATIVE / "lrn.cpp")], capture_output=True, text=True, check=True).stdout
    fused = ("fmla", "fmls", "fmadd", "fmsub", "fnmadd", "fnmsub")   # every fused multiply-add, vector or scalar
    assert "fsqrt\tv" in asm and not [op for op in fused if op in asm]  # NEON vectors, nothing fused
    for name, constants in (("the real programs' (DP clamp)", real), ("no clamp", {**real, "lrn_input_max": 0.0}),
                            ("alpha's multiply, a narrower window", {**real, "lrn_alpha": 0.3, "lrn_gamma": 1.5,
                                                                       "lrn_size": 3})):
        m = constants["lrn_input_max"] or None
        lrn = PaperLRN(channels, constants["lrn_size"], constants["lrn_alpha"], 0.5, constants["lrn_gamma"], m)
        a = torch.relu(x) if m is None else torch.clamp(x, 0.0, m)  # the release program's output beside x
        outs = {label: lrn_isa.run(binary, x[0].numpy(), a[0].numpy(), grad[0].numpy(), constants, tmp_path / "io")
                for label, binary in binaries.items()}
        (first, (forward, backward)), *others = outs.items()
        for label, (f, b) in others:
            assert f.tobytes() == forward.tobytes() and b.tobytes() == backward.tobytes(), (name, label, first)
        # Eager PyTorch within the parity tests' tolerances (splitface.device.runtimes.parity): the release (the
        # LRN's output plus noise) to RELEASE_ATOL, the conv's gradient to GRAD_RTOL of its largest value, as the
        # weight gradients made from it are held. The runner's strip tests hold its LRN to these through the
        # programs; here they hold every path's. Measured: the backward equals conv_grad exactly; the forward
        # differs from PaperLRN by up to two ulps (1.2e-7) in a few values per thousand, where torch.sqrt's
        # vectorised CPU kernel (torch 2.13) is one ulp off the correctly rounded root; the forward is exactly the
        # same steps in numpy's float32 below.
        assert np.abs(forward - lrn(a)[0].numpy()).max() <= RELEASE_ATOL, name
        want = conv_grad(lrn, x, grad)[0].numpy()
        assert np.abs(backward - want).max() <= GRAD_RTOL * np.abs(want).max(), name
        squares, r = a[0].numpy() ** 2, constants["lrn_size"] // 2
        window = np.stack([functools.reduce(np.add, squares[max(o - r, 0):o + r + 1]) for o in range(channels)])
        d = np.float32(constants["lrn_gamma"]) + np.float32(constants["lrn_alpha"]) * window
        assert forward.tobytes() == (a[0].numpy() / np.sqrt(d)).tobytes(), name


@pytest.mark.slow  # the two runner builds
def test_arm64_build_is_arm64_code_with_the_jni_entry_points_of_the_host_build(builds):
    """The runner and libsplitface_jni cross-built for arm64 are arm64 ELF files linked against the aarch64
    wheel's runtime (no libtorch), and the JNI library exports the same Java entry points as the host's (an
    arm64 JVM runs it: tests/test_android_core.py)."""
    host, arm64 = builds("host"), builds("arm64")
    jni = {binary: binary.parent / native_module.JNI_LIBRARY for binary in (host, arm64)}
    assert elf_machine(arm64) == elf_machine(jni[arm64]) == native_module.EM_AARCH64
    assert elf_machine(host) == elf_machine(jni[host]) == native_module.EM_X86_64  # this project's machines
    exports = {}
    for binary, library in jni.items():
        symbols = subprocess.run(["readelf", "--dyn-syms", "-W", str(library)], capture_output=True, text=True,
                                 check=True).stdout.split()
        exports[binary] = {s for s in symbols if s.startswith("Java_org_splitface_")}
    assert exports[arm64] == exports[host] and len(exports[host]) >= 4
    linked = linked_libraries(arm64)
    assert str(native_module.arm64_runtime_dir()) in linked  # its RUNPATH: the aarch64 wheel
    assert "libexecutorch.so" in linked and "torch" not in linked.replace("executorch", "")


def check_noise_dump(noise_isa, binary: Path, dump: Path, label: str) -> None:
    """The harness's normals equal the float64 reference (the float32 polynomials' error, as the runner's own
    test) and its ChaCha20 keystream (the exact option's buffer) equals `NoiseStream`'s bytes exactly."""
    n = 3 * 256 + 37  # whole groups and a part of one
    noise_isa.run(binary, n, 1, dump)
    z, keystream = noise_isa.read_dump(dump, n)
    assert np.abs(z - reference_normals(noise_isa.KEY, n)).max() < 2e-5, label
    assert keystream == NoiseStream(noise_isa.KEY).random_bytes(noise_isa.KEYSTREAM_BYTES), label


class FirstOutput(torch.nn.Module):
    """A program's first output alone: a strip release program of one output, as no current export writes."""

    def __init__(self, program: torch.nn.Module):
        super().__init__()
        self.program = program

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.program(*args)[0]


@pytest.mark.slow
def test_strip_runner_refuses_bad_inputs_by_name(native):
    binary, layer, programs, root = native
    work = root / "strip-bad"
    weight, bias = (np.zeros(tuple(p.shape)) for p in layer.parameters())
    write_inputs(work, {"images": np.zeros((SAMPLES, 3, SIZE + 1, SIZE)), "weight": weight, "bias": bias})
    with pytest.raises(RuntimeError, match=rf"images.f32 holds .* H a multiple of {ROWS}"):
        strip_run(native, work, grad=False)
    write_inputs(work, {"images": np.zeros((SAMPLES, 3, SIZE, SIZE)), "bias": np.zeros(5)})
    with pytest.raises(RuntimeError, match=r"bias.f32 holds 20 bytes; the shared input takes 64"):
        strip_run(native, work, grad=False)
    with pytest.raises(RuntimeError, match="--noise-key needs --noise-std or --noise-discrete"):
        run_native(binary, work, SAMPLES, (programs["strips"] / "release.pte", STRIP_RELEASE), strips=True,
                   noise_key=root / "noise.key", runs=1, warmup=0)
    # strip programs of other formats: without their constant methods, or with another release (one output: the LRN
    # inside, as before the runner took it over, or the conv's output alone, as one revision had it)
    strip, weights = strip_example(layer, ROWS, SIZE), [p.detach() for p in layer.parameters()]
    old_release, old_grad, one_output = root / "strip-old.pte", root / "vjp-old.pte", root / "strip-one-output.pte"
    old_release.write_bytes(lower_to_xnnpack(GemmReleaseProgram(layer, strip=True).eval(), (strip, *weights)))
    grad = torch.zeros(1, weights[0].shape[0], ROWS, SIZE)
    old_grad.write_bytes(lower_to_xnnpack(GemmWeightGrad(layer, strip=True).eval(), (strip, grad, *weights)))
    one_output.write_bytes(lower_to_xnnpack(FirstOutput(GemmReleaseProgram(layer, strip=True)).eval(),
                                            (strip, *weights), strip_constants(layer)))
    for program, why in ((old_release, "carries no lrn_size"),
                         (one_output, "does not return the LRN's input and the conv's output")):
        with pytest.raises(RuntimeError, match=why + ".*: a strip release program of another format; delete it"):
            run_native(binary, work, SAMPLES, (program, STRIP_RELEASE), strips=True, runs=1, warmup=0)
    with pytest.raises(RuntimeError, match="does not take the conv's gradient: .* of another format; delete it"):
        run_native(binary, work, SAMPLES, (programs["strips"] / "release.pte", STRIP_RELEASE), (old_grad, STRIP_GRAD),
                   strips=True, runs=1, warmup=0)
    for exact, why in ((("1/0", 0.1, 10), "takes sigma\\^2 in steps\\^2 as P or P/Q"),
                       ((str(2**60), 0.1, 10), "wider than 2\\^56"), (("4", 0.1, 0), "--clip-steps B >= 1")):
        with pytest.raises(RuntimeError, match=why):
            run_native(binary, work, SAMPLES, (programs["strips"] / "release.pte", STRIP_RELEASE), strips=True,
                       exact=exact, runs=1, warmup=0)


def backend_manifest(layer, batch: int, size: int) -> Manifest:
    """What `export_all` records for `layer` with --gemm (the strip programs need no more of it)."""
    return manifest_of(layer, *example_inputs(layer, batch, size), gemm=True)


def vgg_layer():
    """VGG-Face's conv1 + ReLU + LRN (the small spec's 16 channels) with the DP clamp, as the engine sets it."""
    torch.manual_seed(0)
    layer = build_device_part(resolve_spec("vgg_face_small"), "conv1").eval()
    for lrn in (m for m in layer.modules() if isinstance(m, PaperLRN)):
        lrn.input_max = 1.0
    return layer


def assert_matches_eager(runtime, layer, images, weights, g):
    shape = layer(images[:1]).shape[1:]
    noise, grad = 0.1 * torch.randn((len(images), *shape), generator=g), torch.randn((len(images), *shape), generator=g)
    want_release, want_grads = reference(layer, images, noise, grad, weights)
    assert (runtime.release(images, noise, weights) - want_release).abs().max() <= RELEASE_ATOL
    got = runtime.weight_grads(images, noise, grad, weights)
    for a, b in zip(got, want_grads, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() <= GRAD_RTOL * b.abs().max()
    return got


@pytest.mark.slow  # builds the runner (into the per-user cache) and lowers two strip programs
def test_native_backend_follows_changing_weights_in_one_process(tmp_path):
    layer = vgg_layer()
    runtime = NativeRuntime(layer, tmp_path, backend_manifest(layer, 2, 32), exporter=EXPORTER)
    try:
        assert all(c["ok"] for c in runtime.verification.values()) and len(runtime.verification) == 2
        pid = runtime._server._proc.pid
        g = torch.Generator().manual_seed(5)
        weights = [p.detach().clone() for p in layer.parameters()]
        images = 3 * torch.rand(2, 3, 32, 32, generator=g)  # above the clamp: its mask matters
        grads = assert_matches_eager(runtime, layer, images, weights, g)
        weights = [w - 0.5 * gw for w, gw in zip(weights, grads)]  # a step: the next call must use these
        assert_matches_eager(runtime, layer, images[:1], weights, g)  # and a short last batch
        assert runtime._server._proc.pid == pid and runtime._server._proc.poll() is None
        assert runtime.last_report["op"] == "grad" and runtime.last_report["samples"] == 1
        with pytest.raises(RuntimeError, match=r"noise.f32 holds 4 bytes; 1 maps of 65536 expected"):
            runtime.release(images[:1], torch.zeros(1), weights)
    finally:
        runtime.close()
    assert not runtime._server.scratch.exists()


@pytest.mark.parametrize("change, why", [({"mask_shape": [2, 16, 1, 1]}, "take no mask"),
                                         ({"input_shape": [2, 3, 30, 30]}, "height 30 is not a multiple of")])
def test_native_backend_refuses_what_strips_do_not_cover_before_building(change, why, tmp_path, monkeypatch):
    monkeypatch.setattr(native_module.shutil, "which", lambda tool: None)  # a build would fail differently
    layer = vgg_layer()
    manifest = backend_manifest(layer, 2, 32)
    for key, value in change.items():
        setattr(manifest, key, value)
    with pytest.raises(ValueError, match=f"the native backend cannot run .*{why}"):
        NativeRuntime(layer, tmp_path, manifest, exporter=EXPORTER)
    manifest.gemm_refusal = "the im2col programs cover conv + ReLU + LRN; found Conv2d"
    with pytest.raises(ValueError, match="the native backend runs the im2col programs, and .* has none .*found Conv2d"):
        NativeRuntime(layer, tmp_path, manifest, exporter=EXPORTER)


@pytest.mark.slow
@pytest.mark.parametrize("bound", [7, 2**31 + 1, 2**40 + 3])  # Lemire with few and half rejections, 64-bit words
def test_native_uniform_integers_are_noise_streams(native, bound):
    _, _, _, root = native
    key = bytes(range(40, 72))
    (root / "uniform.key").write_bytes(key)
    got = draw_integers(native[0], root / "uniform", root / "uniform.key", 3000, bound=bound)
    stream = NoiseStream(key)  # one draw at a time reads the stream in the runner's order
    assert got.tolist() == [int(stream.uniform_below(bound, 1)[0]) for _ in range(3000)]


@pytest.mark.slow
def test_native_buffered_keystream_reads_are_noise_streams_bytes(native):
    """The exact option's stream, made 16 blocks (1024 bytes) at a time, read as a mix of bits, bytes and
    little-endian words: the same bytes as NoiseStream's in the same order, words straddling a refill included
    (the 15-byte cycle puts a read across the buffer's end at every offset)."""
    _, _, _, root = native
    key = bytes(range(200, 232))
    (root / "reads.key").write_bytes(key)
    n = 5 * 1024  # 1024 cycles of bit, word64, word32, byte, byte: 15 buffers' worth
    got = draw_integers(native[0], root / "reads", root / "reads.key", n, reads=True)
    data, at, want = NoiseStream(key).random_bytes(15 * 1024), 0, []
    for i in range(n):
        size = (1, 8, 4, 1, 1)[i % 5]
        value = int.from_bytes(data[at:at + size], "little")
        want.append(value >> 7 if i % 5 == 0 else value)  # a bit is its byte's top bit
        at += size
    assert got.tolist() == want


@pytest.mark.slow
# sigma 20 and 6.35 steps; t = 2 with q = 4; the bench's 258064/625; sigma below 1 (t = 1, U always 0)
@pytest.mark.parametrize("sigma2", ["400", "16129/400", "9/4", "258064/625", "1/3"])
def test_native_discrete_gaussian_follows_its_pmf(native, sigma2):
    binary, _, _, root = native
    key = bytes(range(80, 112))
    (root / "discrete.key").write_bytes(key)
    n = 200_000
    z = draw_integers(binary, root / "discrete", root / "discrete.key", n, sigma2=sigma2)
    law = DiscreteGaussian(sigma2)
    assert abs(z.mean()) < 5 * np.sqrt(law.variance() / n)
    assert abs(z.var() / law.variance() - 1) < 5 * np.sqrt(2 / n)
    edge = int(3 * np.sqrt(float(law.sigma2)))  # every value within 3 sigma, the two tails pooled
    support = np.arange(-edge, edge + 1)
    expected = n * np.append(law.pmf(support), 1 - law.pmf(support).sum())
    counts = np.append([(z == v).sum() for v in support], (np.abs(z) > edge).sum())
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof)  # about 5 standard deviations of the chi-square statistic
    assert np.array_equal(z, draw_integers(binary, root / "discrete", root / "discrete.key", n, sigma2=sigma2))


@pytest.mark.slow
def test_strip_release_with_exact_noise_is_python_quantised_eager_plus_samples(native):
    """The runner's int8 release minus its discrete samples under the same key is the integer vector that
    discrete.py's clip_quantise makes of eager PyTorch's release, each image's norm within B steps; without a
    key file every release draws afresh."""
    binary, layer, programs, root = native
    g = torch.Generator().manual_seed(6)
    images = torch.rand(SAMPLES, 3, SIZE, SIZE, generator=g)
    weights = [p.detach() + 0.05 * torch.randn(p.shape, generator=g) for p in layer.parameters()]
    mechanism = DiscreteGaussianMechanism(clip_norm=4.0, noise_multiplier=0.05)
    info = mechanism.describe()
    exact = (info["sigma2_steps"], info["step"], info["bound_steps"])
    work = root / "exact-io"
    write_inputs(work, {"images": images.numpy(), "weight": weights[0].numpy(), "bias": weights[1].numpy()})
    key = bytes(range(150, 182))
    (root / "exact.key").write_bytes(key)
    released = run_native(binary, work, SAMPLES, (programs["strips"] / "release.pte", STRIP_RELEASE), runs=1,
                          warmup=0, strips=True, exact=exact, noise_key=root / "exact.key")["release"].astype(np.int64)
    z = draw_integers(binary, root / "exact-draw", root / "exact.key", released.size, sigma2=exact[0])
    assert np.abs(released).max() < 127  # nothing clamped here, so the integers are q + z exactly
    q = (released - z).reshape(SAMPLES, -1)
    eager = reference(layer, images, torch.zeros(1), torch.zeros(1), weights, grads=False)[0]
    assert (eager.flatten(1).norm(dim=1) > 2 * mechanism.clip_norm).all()  # every image is clipped
    want = clip_quantise(eager, mechanism.step, mechanism.bound)
    assert (squared_norms(q) <= mechanism.bound**2).all() and (squared_norms(q) > 0).all()
    assert np.abs(q - want).max() <= 1 and (q != want).mean() < 1e-3  # a rounding tie may fall the other way
    fresh = [run_native(binary, work, SAMPLES, (programs["strips"] / "release.pte", STRIP_RELEASE), runs=1, warmup=0,
                        strips=True, exact=exact)["release"] for _ in range(2)]
    assert (fresh[0] != fresh[1]).mean() > 0.5


def test_a_dead_runner_leaves_no_files_and_closes_cleanly(tmp_path):
    """A runner that exits at once (here /bin/true): the request raises with its exit code, and close() still removes
    the scratch directory with the inputs written into it (it used to re-raise the broken pipe and keep them)."""
    server = StripServer(Path("/bin/true"), tmp_path / "r.pte", tmp_path / "g.pte", ["w0"])
    images = np.zeros((1, 3, 4, 4), np.float32)
    with pytest.raises(RuntimeError, match=r"--serve stopped \(0\)"):
        for _ in range(3):   # the first write may still land in the pipe's buffer
            server.release({"images": images, "noise": images, "w0": images}, 1)
    assert (server.scratch / "images.f32").exists()
    server.close()
    assert not server.scratch.exists()


def test_a_runner_that_cannot_start_leaves_no_scratch_directory(tmp_path, monkeypatch):
    made = []
    real = native_module._scratch
    monkeypatch.setattr(native_module, "_scratch", lambda: made.append(real()) or made[-1])
    with pytest.raises(FileNotFoundError):
        StripServer(tmp_path / "no-such-runner", tmp_path / "r.pte", tmp_path / "g.pte", ["w0"])
    assert made and not made[0].exists()


def exact_params(mechanism: DiscreteGaussianMechanism) -> tuple[str, float, int]:
    """The runner's --noise-discrete, --quant-step and --clip-steps for `mechanism`."""
    info = mechanism.describe()
    return info["sigma2_steps"], info["step"], info["bound_steps"]


def vgg_engine(mechanism, runtime=None, layer=None):
    """A device engine on VGG-Face's conv1 (small, 32 px) with `mechanism` (secret fixed: every engine draws the
    same keys), holding `layer`'s weights and the LRN clamp that the runner's programs hold."""
    import dataclasses

    from splitface.device.trainer import DeviceTrainer, PrivacyEngine
    from splitface.common.optim import TrainConfig

    spec = dataclasses.replace(resolve_spec("vgg_face_small"), input_size=32)
    engine = DeviceTrainer(spec, "conv1", "server", 4, TrainConfig(lr=0.5, momentum=0.0),
                          PrivacyEngine(mechanism=mechanism, secret=7))
    if layer is not None:
        engine.layer.load_state_dict(layer.state_dict())
        for lrn in (m for m in engine.layer.modules() if isinstance(m, PaperLRN)):
            lrn.input_max = 1.0
    if runtime is not None:
        engine.attach_runtime(runtime)
    return engine


@pytest.mark.slow  # builds the runner (into the per-user cache) and lowers two strip programs
def test_native_backend_exact_release_is_keyed_and_trains_like_eager(tmp_path):
    """The native backend's exact release under a key is discrete.py's clip_quantise of eager PyTorch's release
    plus the runner's own samples under that key (the strip test's check), repeated exactly on a replay with the
    key and different under another; through the engine, a re-sent release repeats its integers and is counted
    once, the accountant's figures are the eager engine's, and the straight-through weight gradient (the layer's
    own vector-Jacobian product: the clip and the rounding pass the gradient unchanged) matches eager PyTorch's."""
    layer = vgg_layer()
    runtime = NativeRuntime(layer, tmp_path, backend_manifest(layer, 2, 32), exporter=EXPORTER)
    try:
        mechanism = DiscreteGaussianMechanism(clip_norm=4.0, noise_multiplier=0.05)
        sigma2, _, _ = exact_params(mechanism)
        g = torch.Generator().manual_seed(8)
        images = torch.rand(2, 3, 32, 32, generator=g)
        weights = [p.detach() + 0.05 * torch.randn(p.shape, generator=g) for p in layer.parameters()]
        key = bytes(range(200, 232))
        released = runtime.exact_release(images, weights, mechanism, key)
        assert released.dtype == np.int8 and released.shape == (2, 16 * 32 * 32)
        server = runtime._exact[exact_params(mechanism)]
        assert not (server.scratch / "key").exists()  # the runner consumed the request's key
        assert np.array_equal(runtime.exact_release(images, weights, mechanism, key), released)  # a replay
        other = runtime.exact_release(images, weights, mechanism, bytes(range(1, 33)))
        assert (other != released).mean() > 0.5
        (tmp_path / "exact.key").write_bytes(key)
        z = draw_integers(runtime._start[0], tmp_path / "exact-draw", tmp_path / "exact.key", released.size, sigma2=sigma2)
        assert np.abs(released).max() < 127  # nothing clamped, so the integers are q + z exactly
        q = released.astype(np.int64) - z.reshape(released.shape)
        eager = reference(layer, images, torch.zeros(1), torch.zeros(1), weights, grads=False)[0]
        assert (eager.flatten(1).norm(dim=1) > 2 * mechanism.clip_norm).all()  # every image is clipped
        want = clip_quantise(eager, mechanism.step, mechanism.bound)
        assert (squared_norms(q) <= mechanism.bound**2).all()
        assert np.abs(q - want).max() <= 1 and (q != want).mean() < 1e-3  # a rounding tie may fall the other way
        with pytest.raises(ValueError, match="32 bytes"):
            runtime.exact_release(images, weights, mechanism, b"short")

        # the engine: the native engine's release, replay, accounting and step against eager PyTorch's
        torch_engine, native_engine = vgg_engine(mechanism, layer=layer), vgg_engine(mechanism, runtime, layer)
        pixels = (255 * images).to(torch.uint8).numpy()
        grad = torch.randn(2, 16, 32, 32, generator=g).numpy()
        out = {}
        for name, engine in (("torch", torch_engine), ("native", native_engine)):
            first = engine.forward(pixels, ("train", 1, 0), [0, 1], [0, 1])
            assert np.array_equal(engine.forward(pixels, ("train", 1, 0), [0, 1], [0, 1]), first)  # re-sent
            integers = first / np.float32(mechanism.step)
            assert np.array_equal(integers, np.round(integers)) and np.abs(integers).max() <= 127
            before = [p.detach().clone() for p in engine.layer.parameters()]
            engine.commit(1, grad)
            out[name] = {"step": [b - p.detach() for b, p in zip(before, engine.layer.parameters())],
                         "privacy": engine.privacy.accountant.report(), "released": first}
        assert out["native"]["privacy"] == out["torch"]["privacy"]  # one release per image, counted once
        assert out["native"]["privacy"]["epsilon_image"]["max"] > 0
        assert (out["native"]["released"] != out["torch"]["released"]).mean() > 0.5  # different samplers, same law
        for got, want in zip(out["native"]["step"], out["torch"]["step"], strict=True):
            assert (got - want).abs().max() <= GRAD_RTOL * want.abs().max()
        with pytest.raises(RuntimeError, match="exact release needs its key in .*none was written for this request"):
            server.request("release", 2, {"images": images.numpy(), **runtime._weights(weights)})  # no key: stops
    finally:
        runtime.close()
    assert not runtime._server.scratch.exists() and not server.scratch.exists()


@pytest.mark.slow  # builds the runner (into the per-user cache) and lowers two strip programs
def test_native_backend_draws_the_engines_noise_under_the_release_key(tmp_path):
    """The float option in the runner: a keyed release is eager PyTorch's plus std times the key's ChaCha8 +
    Box-Muller normals (the float64 reference), repeated exactly on a replay and different under another key;
    std 0 adds nothing. Through the engine, the release's key is the engine's per-release key, a re-sent release
    is bit-identical and counted once, the accountant's figures are the eager engine's, and the step equals
    eager PyTorch's (the noise does not enter the weight gradient)."""
    from splitface.device.privacy.mechanisms import NoNoise, PerActivationGaussian

    layer = vgg_layer()
    runtime = NativeRuntime(layer, tmp_path, backend_manifest(layer, 2, 32), exporter=EXPORTER)
    try:
        g = torch.Generator().manual_seed(9)
        images = torch.rand(2, 3, 32, 32, generator=g)
        weights = [p.detach() + 0.05 * torch.randn(p.shape, generator=g) for p in layer.parameters()]
        eager = reference(layer, images, torch.zeros(1), torch.zeros(1), weights, grads=False)[0].reshape(2, -1)
        key = bytes(range(50, 82))
        released = runtime.keyed_release(images, weights, 0.5, key)
        assert released.shape == (2, 16 * 32 * 32) and not (runtime._keyed[0.5].scratch / "key").exists()
        normals = torch.from_numpy(reference_normals(key, released.numel())).float().reshape(2, -1)
        assert (released - eager - 0.5 * normals).abs().max() <= RELEASE_ATOL + 0.5 * 2e-5
        assert torch.equal(runtime.keyed_release(images, weights, 0.5, key), released)  # a replay
        assert (runtime.keyed_release(images, weights, 0.5, bytes(32)) != released).float().mean() > 0.99
        assert (runtime.keyed_release(images, weights, 0.0, key) - eager).abs().max() <= RELEASE_ATOL  # no noise
        with pytest.raises(ValueError, match="32 bytes"):
            runtime.keyed_release(images, weights, 0.5, b"short")

        mechanism = PerActivationGaussian(3.0, 1e-5)
        engines = {"noiseless": vgg_engine(NoNoise(), layer=layer), "torch": vgg_engine(mechanism, layer=layer),
                   "native": vgg_engine(mechanism, runtime, layer)}
        pixels = (255 * images).to(torch.uint8).numpy()
        grad = torch.randn(2, 16, 32, 32, generator=g).numpy()
        out = {}
        for name, engine in engines.items():
            first = engine.forward(pixels, ("train", 1, 0), [0, 1], [0, 1])
            assert np.array_equal(engine.forward(pixels, ("train", 1, 0), [0, 1], [0, 1]), first)  # re-sent
            before = [p.detach().clone() for p in engine.layer.parameters()]
            engine.commit(1, grad)
            out[name] = {"step": [b - p.detach() for b, p in zip(before, engine.layer.parameters())],
                         "privacy": engine.privacy.accountant.report(), "released": first}
        native = engines["native"]
        key = native.privacy.stream_key(native.privacy.generator(("train", 1, 0)))
        normals = reference_normals(key, out["native"]["released"].size).reshape(out["native"]["released"].shape)
        noise = out["native"]["released"] - out["noiseless"]["released"]
        assert np.abs(noise - mechanism.std * normals).max() <= RELEASE_ATOL + mechanism.std * 2e-5
        assert out["native"]["privacy"] == out["torch"]["privacy"]  # one release per image, counted once
        assert out["native"]["privacy"]["epsilon_image"]["max"] > 0
        for got, want in zip(out["native"]["step"], out["torch"]["step"], strict=True):
            assert (got - want).abs().max() <= GRAD_RTOL * want.abs().max()
        server = runtime._keyed[mechanism.std]
        with pytest.raises(RuntimeError, match="noisy release needs its key in .*none was written for this request"):
            server.request("release", 2, {"images": images.numpy(), **runtime._weights(weights)})  # no key: stops
    finally:
        runtime.close()
    assert all(not s.scratch.exists() for s in (runtime._server, *runtime._keyed.values()))


def simulate_exact(backend: str, lfw, tmp_path) -> dict:
    """One epoch of VGG-Face's conv1 (64 px, batch 2, 4 images) through `backend` against a loopback server, with
    the privacy options as the simulator's command line gives them (--mechanism per-image --noise discrete)."""
    import argparse
    import asyncio

    from splitface.common.data import load_lfw
    from splitface.common.optim import TrainConfig
    from splitface.device.privacy.options import add_privacy_args, privacy_engines
    from splitface.sim.simulator import SimConfig, simulate
    from tests.conftest import TOKENS, serve_in_thread, small_trainer

    parser = argparse.ArgumentParser()
    add_privacy_args(parser)
    args = parser.parse_args(["--mechanism", "per-image", "--noise", "discrete", "--clip-norm", "4",
                              "--noise-multiplier", "2"])
    data = load_lfw(lfw, min_images=10, max_identities=4)
    data.train, data.test = data.train.subset(np.arange(4)), data.test.subset(np.arange(2))
    config = SimConfig(url="", spec=resolve_spec("vgg_face_small"), num_devices=1, epochs=1, batch_size=2,
                       progress=False, train=TrainConfig(lr=0.05), backend=backend, artifacts=tmp_path / "artifacts",
                       privacy=privacy_engines(args, releases_per_image=1))
    with serve_in_thread(small_trainer(len(data.class_names), lr=0.05), tmp_path / "run") as server:
        config.url = server.url
        return asyncio.run(simulate(config, data, {"device-0": TOKENS["device-0"]}))["devices"][0]


@pytest.mark.slow  # builds the runner, lowers the strip programs, trains against a real server
def test_simulator_with_native_exact_noise_spends_what_eager_spends(lfw, tmp_path, monkeypatch):
    """`--backend native --mechanism per-image --noise discrete` completes a short run against a loopback server
    (int8 integers on the wire), every release made by the runner, and its accountant spent what the eager
    engine's spent for the same releases."""
    calls = []
    exact_release = NativeRuntime.exact_release
    monkeypatch.setattr(NativeRuntime, "exact_release", lambda self, *a: calls.append(1) or exact_release(self, *a))
    runs = {backend: simulate_exact(backend, lfw, tmp_path / backend) for backend in ("torch", "native")}
    assert len(calls) == 2 + 1  # two training batches and one evaluation batch, none made in eager PyTorch
    native, eager = runs["native"], runs["torch"]
    assert native["privacy"]["mechanism"] == eager["privacy"]["mechanism"]
    assert native["privacy"]["mechanism"]["name"] == "discrete_gaussian"
    for level in ("epsilon_image", "epsilon_identity"):
        assert native["privacy"][level] == eager["privacy"][level]
    assert native["privacy"]["epsilon_image"]["max"] > 0
    assert len(native["epochs"]) == 1 and np.isfinite(native["epochs"][0]["train_loss"])


def test_exact_noise_needs_a_runtime_that_makes_the_whole_release():
    """A runtime that only adds the float noise it is given (ExecuTorch, ONNX Runtime) is refused for the exact
    option before any release, naming the backends that run it."""
    from types import SimpleNamespace

    engine = vgg_engine(DiscreteGaussianMechanism(clip_norm=4.0, noise_multiplier=1.0))
    with pytest.raises(ValueError, match="the executorch backend adds float noise .*runs on --backend native or torch"):
        engine.attach_runtime(SimpleNamespace(name="executorch", static_weights=False))
