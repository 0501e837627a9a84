package org.splitface.core;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The app's folder from {@code splitface-export --app} (splitface/export/app_bundle.py, which names the same files): the
 * strip programs, the starting layer, the job and bundle.msgpack, the manifest of every file's size and SHA-256.
 * {@link #load} checks the folder against its manifest and the job against itself before anything is built; the
 * programs' geometry is checked against the layer and the image size when the trainer is built ({@link #trainer}).
 * Every refusal is an {@link Invalid} that names the file and what is wrong with it.
 */
public final class AppBundle {
    public static final String FORMAT = "splitface-app";
    // 2: the strip programs hold only the conv's GEMMs and the clamp; the strip layer does the LRN and its backward
    public static final int VERSION = 2;
    public static final String MANIFEST = "bundle.msgpack", LAYER = "layer.msgpack", JOB = "job.msgpack",
            SCHEDULE = "schedule.msgpack", RELEASE = "release_strip.pte", VJP = "vjp_strip.pte";
    /** export's URL_PLACEHOLDER: a job exported without --url; the app must be given the server's. */
    public static final String URL_PLACEHOLDER = "wss://EDGE-SERVER.invalid:8765";
    private static final List<String> REQUIRED = List.of(RELEASE, VJP, LAYER, JOB);
    private static final List<String> ENCODINGS = List.of("f32", "f16", "i8");

    /** The folder does not match its manifest, or its job cannot run: nothing was built or sent. */
    public static final class Invalid extends IllegalArgumentException {
        public Invalid(String message) { super(message); }
    }

    public final Path dir;
    public final int stripRows, inputSize, batchSize, epochs, numClasses;
    public final Map<String, Object> job, model;
    public final String split;
    /** The server's class names in label order (the app's faces/<name>/ folders), or null: not exported. */
    public final List<String> classes;
    public final Map<String, String> encodings = new LinkedHashMap<>();
    private final Map<String, Object> layerJob;
    private final byte[] schedule;   // null: no budget

    private AppBundle(Path dir, Map<String, Object> manifest, Map<String, Object> layerJob, Map<String, Object> job,
                      byte[] schedule) {
        this.dir = dir; this.layerJob = layerJob; this.job = job; this.schedule = schedule;
        stripRows = positive(manifest, "strip_rows", MANIFEST);
        inputSize = positive(manifest, "input_size", MANIFEST);
        batchSize = positive(job, "batch_size", JOB);
        epochs = positive(job, "epochs", JOB);
        numClasses = positive(job, "num_classes", JOB);
        model = map(job, "model", JOB);
        split = (String) job.get("split");
        if (!"conv1".equals(split)) throw new Invalid(JOB + ": the strip trainer runs the conv1 split, not " + split);
        for (Map.Entry<?, ?> e : map(job, "encodings", JOB).entrySet()) {
            if (!ENCODINGS.contains(e.getValue()))
                throw new Invalid(JOB + ": encoding " + e.getValue() + " for " + e.getKey() + " is not one of " + ENCODINGS);
            encodings.put((String) e.getKey(), (String) e.getValue());
        }
        if (job.get("epsilon") != null) {
            Object max = ((Map<?, ?>) layerJob.get("lrn")).get("input_max");
            if (max == null || ((Number) max).doubleValue() != 1.0)
                throw new Invalid(JOB + " asks for per-activation noise, but " + LAYER + "'s LRN inputs are not clamped "
                        + "to [0, 1]: its sensitivity would not hold (export with --dp-clamp)");
        }
        List<String> names = null;   // not Stream.toList: Android has it from API 34 only
        if (job.get("classes") != null) {
            names = new java.util.ArrayList<>();
            for (Object name : (List<?>) job.get("classes")) names.add(String.valueOf(name));
        }
        classes = names;
        if (classes != null && classes.size() != numClasses)
            throw new Invalid(JOB + " names " + classes.size() + " classes for num_classes " + numClasses);
        if ((schedule == null) != (job.get("budget") == null))
            throw new Invalid(JOB + (schedule == null ? " has a budget but the manifest lists no " + SCHEDULE
                    : " has no budget but the folder has a " + SCHEDULE));
    }

    /** The folder, checked against its manifest: every file there, of its size and SHA-256, and the job coherent. */
    @SuppressWarnings("unchecked")
    public static AppBundle load(Path dir) throws IOException {
        Path manifestPath = dir.resolve(MANIFEST);
        if (!Files.isRegularFile(manifestPath))
            throw new Invalid(dir + " has no " + MANIFEST + ": not a folder from splitface-export --app");
        Map<String, Object> manifest;
        try {
            manifest = (Map<String, Object>) Wire.unpack(Files.readAllBytes(manifestPath));
        } catch (RuntimeException e) {
            throw new Invalid(manifestPath + " is not a manifest: " + e.getMessage());
        }
        if (!FORMAT.equals(manifest.get("format")) || !(manifest.get("version") instanceof Number v) || v.longValue() != VERSION)
            throw new Invalid(manifestPath + " is format " + manifest.get("format") + " version " + manifest.get("version")
                    + "; this app reads " + FORMAT + " version " + VERSION + " (export again with this release)");
        Map<String, Object> files = map(manifest, "files", MANIFEST);
        for (String name : REQUIRED)
            if (!files.containsKey(name)) throw new Invalid(MANIFEST + " lists no " + name + ": the folder is incomplete");
        Map<String, byte[]> content = new LinkedHashMap<>();
        for (Map.Entry<String, Object> e : files.entrySet()) {
            String name = e.getKey();
            if (name.contains("/") || name.contains("\\") || name.startsWith("."))
                throw new Invalid(MANIFEST + " lists " + name + ", which is not a file of this folder");
            Path file = dir.resolve(name);
            if (!Files.isRegularFile(file)) throw new Invalid(file + " is missing (listed in " + MANIFEST + ")");
            Map<?, ?> expect = (Map<?, ?>) e.getValue();
            byte[] bytes = Files.readAllBytes(file);
            long size = ((Number) expect.get("bytes")).longValue();
            String sha = sha256(bytes);
            if (bytes.length != size || !sha.equals(expect.get("sha256")))
                throw new Invalid(file + " does not match " + MANIFEST + ": " + bytes.length + " bytes, sha256 " + sha
                        + "; expected " + size + " bytes, sha256 " + expect.get("sha256")
                        + " (a partial copy, or a file of another export)");
            content.put(name, bytes);
        }
        return new AppBundle(dir, manifest, (Map<String, Object>) Wire.unpack(content.get(LAYER)),
                (Map<String, Object>) Wire.unpack(content.get(JOB)), content.get(SCHEDULE));
    }

    /** The server's URL: `override` (what the user typed) if given, else the job's; never the export's placeholder. */
    public String url(String override) {
        String url = override != null && !override.isBlank() ? override.trim() : (String) job.get("url");
        if (url == null || url.equals(URL_PLACEHOLDER))
            throw new Invalid(JOB + " names no server (exported without --url): give the server's URL");
        return url;
    }

    /** A fresh copy of the starting layer (the exported weights). */
    public DeviceLayer layer() { return Cli.layer(layerJob); }

    public int batchesPerEpoch(int images) { return (images + batchSize - 1) / batchSize; }

    /** SGD over the layer, its decay spread over the whole run, as `Cli train`. */
    public Sgd sgd(DeviceLayer layer, int images) {
        return new Sgd(new float[][] {layer.weight, layer.bias}, Cli.d(job.get("lr")), Cli.d(job.get("momentum")),
                Cli.d(job.get("weight_decay")), Cli.d(job.get("lr_decay")), (long) batchesPerEpoch(images) * epochs);
    }

    /**
     * The strip trainer on this folder's programs (libsplitface_jni must be loaded), refused by name when the
     * programs were exported for another layer, strip height or image width.
     */
    public StripLayerTrainer trainer(DeviceLayer layer, Sgd sgd) {
        StripLayerTrainer trainer = new StripLayerTrainer(dir.resolve(RELEASE), dir.resolve(VJP), layer, sgd);
        int[] g = trainer.geometry();   // {C, O, rows, width, kh, kw}
        int[] want = {layer.cin, layer.cout, stripRows, inputSize, layer.k, layer.k};
        if (!java.util.Arrays.equals(g, want)) {
            trainer.close();
            throw new Invalid(RELEASE + " takes {channels in, out, strip rows, width, kernel} = "
                    + java.util.Arrays.toString(g) + ", but " + LAYER + " and " + MANIFEST + " say "
                    + java.util.Arrays.toString(want));
        }
        return trainer;
    }

    public ClientSession session(String deviceId, String token) {
        return new ClientSession(deviceId, token, model, split, "server", batchSize, numClasses, encodings);
    }

    /** The per-activation noise of the job, or null (no noise). */
    public PerActivationNoise noise() {
        return job.get("epsilon") == null ? null : new PerActivationNoise(Cli.d(job.get("epsilon")), Cli.d(job.get("delta")));
    }

    /** The budget guard of the job's schedule and budget, or null (no budget). */
    public BudgetGuard guard() { return schedule == null ? null : BudgetGuard.fromSchedule(schedule, Cli.d(job.get("budget"))); }

    static String sha256(byte[] bytes) {
        try {
            StringBuilder hex = new StringBuilder();   // not HexFormat: Android has it from API 34 only
            for (byte b : MessageDigest.getInstance("SHA-256").digest(bytes)) hex.append(String.format("%02x", b));
            return hex.toString();
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        }
    }

    @SuppressWarnings("unchecked")
    private static Map<String, Object> map(Map<String, Object> m, String key, String file) {
        if (!(m.get(key) instanceof Map)) throw new Invalid(file + " has no " + key);
        return (Map<String, Object>) m.get(key);
    }

    private static int positive(Map<String, Object> m, String key, String file) {
        if (!(m.get(key) instanceof Number n) || n.longValue() < 1)
            throw new Invalid(file + ": " + key + " must be a positive integer, not " + m.get(key));
        return (int) n.longValue();
    }
}
