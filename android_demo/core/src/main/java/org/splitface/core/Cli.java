package org.splitface.core;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Command-line entry points on a msgpack job file (what tests/test_android_core.py writes):
 *   parity JOB OUT   run the device layer forward and backward, write the results
 *   bench JOB        time the layer's forward and weight gradient ("warmup" and "runs" in the job; "threads": 1 runs
 *                    ExecuTorch on the calling thread), one JSON line with the times in ms and the JVM's peak RSS
 * A job with "programs" runs the layer through ExecuTorch's C++ runtime (JNI; {@link #trainer}) instead of the
 * plain-Java reference layer.
 *   train JOB [--ca-file PEM] [--insecure] [--max-message-bytes N]
 *                    train against the server in the job, one JSON line of metrics per batch. wss:// trusts the
 *                    CA certificates in --ca-file (else the platform's) and checks the host name; plain ws:// is
 *                    refused off loopback unless --insecure (the token would travel in clear). Exit status: 0 done,
 *                    2 refused by the server, 3 privacy budget spent, 4 connection lost, 5 server certificate
 *                    not accepted, 64 usage (a refused URL included). A job with "weights_out" (a path) appends
 *                    each committed batch's layer after its step there: the batch id (int64) then the weight and
 *                    the bias if any (float32), little-endian; the tests replay every step from it. With
 *                    "state_dir" the budget and the training progress are durable there: a restarted device
 *                    resumes both (6: a state file that fails its checks).
 *   app DIR DEVICE [--ca-file PEM] [--insecure] [--max-message-bytes N]
 *                    the app's run ({@link AppRun}) on a splitface-export --app folder: {@link #app}.
 */
public final class Cli {
    private Cli() {}

    static final String USAGE = "usage: parity JOB OUT | bench JOB | train JOB [OPTIONS] | app DIR DEVICE [OPTIONS]; OPTIONS: "
            + "[--ca-file PEM] [--insecure] [--max-message-bytes N]";

    public static void main(String[] args) throws Exception {
        if (args.length < 2) { System.err.println(USAGE); System.exit(64); }
        if (args[0].equals("app")) {   // its first argument is a folder
            if (args.length < 3) { System.err.println(USAGE); System.exit(64); }
            @SuppressWarnings("unchecked") Map<String, Object> device = (Map<String, Object>) Wire.unpack(Files.readAllBytes(Path.of(args[2])));
            System.exit(app(Path.of(args[1]), device, Arrays.copyOfRange(args, 3, args.length)));
        }
        @SuppressWarnings("unchecked") Map<String, Object> job = (Map<String, Object>) Wire.unpack(Files.readAllBytes(Path.of(args[1])));
        switch (args[0]) {
            case "parity": parity(job, Path.of(args[2])); break;
            case "bench": bench(job); break;
            case "train": System.exit(train(job, Arrays.copyOfRange(args, 2, args.length))); break;
            default: System.err.println("unknown command " + args[0]); System.exit(64);
        }
    }

    static DeviceLayer layer(Map<String, Object> job) {
        Map<?, ?> conv = (Map<?, ?>) job.get("conv"), lrn = (Map<?, ?>) job.get("lrn");
        float[] w = floats((byte[]) job.get("weight"));
        Object b = job.get("bias");
        int cout = i(conv.get("cout")), cin = i(conv.get("cin")), k = i(conv.get("k"));
        Object max = lrn.get("input_max");
        DeviceLayer layer = new DeviceLayer(cin, cout, k, i(conv.get("stride")), i(conv.get("pad")), b != null,
                i(lrn.get("size")), d(lrn.get("alpha")), d(lrn.get("beta")), d(lrn.get("gamma")), max == null ? null : d(max));
        System.arraycopy(w, 0, layer.weight, 0, w.length);
        if (b != null) System.arraycopy(floats((byte[]) b), 0, layer.bias, 0, layer.bias.length);
        return layer;
    }

    /** uint8 NCHW pixels -> float in [0, 1], as splitface.device.trainer.to_input. */
    static float[] pixels(byte[] data) {
        float[] out = new float[data.length];
        for (int j = 0; j < data.length; j++) out[j] = (data[j] & 0xff) / 255.0f;
        return out;
    }

    /**
     * The job's "programs": {"library": libsplitface_jni, "kind": "gemm" or "strips", "release", "vjp": the .pte
     * files}: the layer through ExecuTorch's C++ runtime with the job's weights, on the batch im2col programs
     * ({@link GemmLayerTrainer}) or the strip programs ({@link StripLayerTrainer}); without them the plain-Java
     * reference layer.
     */
    static LayerTrainer trainer(Map<String, Object> job, DeviceLayer layer, Sgd sgd) {
        Map<?, ?> programs = (Map<?, ?>) job.get("programs");
        if (programs == null) return new ReferenceLayerTrainer(layer, sgd);
        NativeProgram.loadLibrary(Path.of((String) programs.get("library")));
        if (job.get("threads") != null) NativeProgram.singleThreaded(i(job.get("threads")) == 1);
        Path release = Path.of((String) programs.get("release")), vjp = Path.of((String) programs.get("vjp"));
        switch ((String) programs.get("kind")) {
            case "gemm": return new GemmLayerTrainer(new NativeProgram(release), new NativeProgram(vjp), layer, sgd);
            case "strips": return new StripLayerTrainer(release, vjp, layer, sgd);
            default: throw new IllegalArgumentException("programs' kind is gemm or strips, not " + programs.get("kind"));
        }
    }

    static void parity(Map<String, Object> job, Path out) throws Exception {
        DeviceLayer layer = layer(job);
        int[] shape = ints((List<?>) job.get("shape"));
        float[] images = pixels((byte[]) job.get("images")), grad = floats((byte[]) job.get("grad"));
        LayerTrainer trainer = trainer(job, layer, null);
        float[] y = trainer.forward(images, shape[0], shape[2], shape[3]);
        float[][] g = trainer.weightGrads(grad);
        Map<String, Object> result = new LinkedHashMap<>();
        result.put("out", bytes(y));
        result.put("grad_weight", bytes(g[0]));
        result.put("grad_bias", g[1] == null ? null : bytes(g[1]));
        Files.write(out, Wire.pack(result));
    }

    static void bench(Map<String, Object> job) throws Exception {
        DeviceLayer layer = layer(job);
        int[] shape = ints((List<?>) job.get("shape"));
        float[] images = pixels((byte[]) job.get("images")), grad = floats((byte[]) job.get("grad"));
        LayerTrainer trainer = trainer(job, layer, null);
        int warmup = i(job.get("warmup")), runs = i(job.get("runs"));
        StringBuilder forward = new StringBuilder(), backward = new StringBuilder();
        for (int r = 0; r < warmup + runs; r++) {
            long t0 = System.nanoTime();
            trainer.forward(images, shape[0], shape[2], shape[3]);
            long t1 = System.nanoTime();
            trainer.weightGrads(grad);
            long t2 = System.nanoTime();
            if (r < warmup) continue;
            forward.append(forward.length() == 0 ? "" : ", ").append((t1 - t0) / 1e6);
            backward.append(backward.length() == 0 ? "" : ", ").append((t2 - t1) / 1e6);
        }
        long peak = -1;
        for (String line : Files.readAllLines(Path.of("/proc/self/status")))
            if (line.startsWith("VmHWM:")) peak = Long.parseLong(line.replaceAll("[^0-9]", ""));
        System.out.println("{\"trainer\": \"" + trainer.getClass().getSimpleName() + "\", \"forward_ms\": [" + forward + "], \"grad_ms\": [" + backward
                + "], \"peak_kb\": " + peak + "}");
    }

    @SuppressWarnings("unchecked")
    static int train(Map<String, Object> job, String[] options) throws Exception {
        Connection connection;
        try {
            connection = Connection.parse((String) job.get("url"), options);   // before anything is built or sent
        } catch (IllegalArgumentException e) {
            System.err.println("ERROR " + e.getMessage());
            return 64;
        }
        Tls tls = connection.tls;
        long maxMessageBytes = connection.maxMessageBytes;
        DeviceLayer layer = layer(job);
        int[] shape = ints((List<?>) job.get("shape"));     // all images: [N, 3, H, W]
        float[] images = pixels((byte[]) job.get("images"));
        int[] labels = ints((List<?>) job.get("labels"));
        int batch = i(job.get("batch_size")), epochs = i(job.get("epochs"));
        Map<String, String> enc = new LinkedHashMap<>();
        enc.put("activations", "f32");
        enc.put("gradients", "f32");
        ClientSession session = new ClientSession((String) job.get("device_id"), (String) job.get("token"),
                (Map<String, Object>) job.get("model"), (String) job.get("split"), "server", batch, i(job.get("num_classes")), enc);
        int batchesPerEpoch = (shape[0] + batch - 1) / batch;
        Sgd sgd = new Sgd(new float[][] {layer.weight, layer.bias}, d(job.get("lr")), d(job.get("momentum")),
                d(job.get("weight_decay")), d(job.get("lr_decay")), (long) batchesPerEpoch * epochs);
        PerActivationNoise noise = job.get("epsilon") == null ? null : new PerActivationNoise(d(job.get("epsilon")), d(job.get("delta")));
        BudgetGuard guard = job.get("schedule") == null ? null
                : BudgetGuard.fromSchedule((byte[]) job.get("schedule"), d(job.get("budget")));
        try {
            if (guard != null && job.get("state_dir") != null)   // durable: a restarted device resumes its releases
                guard.persistIn(BudgetGuard.stateFile(Path.of((String) job.get("state_dir")), session.deviceId), session.deviceId);
        } catch (BudgetGuard.StateFileError e) {
            System.err.println("ERROR " + e.getMessage());
            return 6;
        }
        int plane = shape[1] * shape[2] * shape[3];
        Path weightsOut = job.get("weights_out") == null ? null : Path.of((String) job.get("weights_out"));
        if (weightsOut != null) Files.write(weightsOut, new byte[0]);
        try (DeviceClient client = new DeviceClient((String) job.get("url"), JdkWebSocketTransport.factory(tls), session,
                trainer(job, layer, sgd), noise, guard, 120_000, 30, maxMessageBytes)) {
            if (job.get("state_dir") != null) {   // durable: a restarted device resumes its committed batch
                try {
                    client.persistIn(new TrainingState(TrainingState.stateFile(Path.of((String) job.get("state_dir")),
                            session.deviceId), session));
                } catch (BudgetGuard.StateFileError e) {
                    System.err.println("ERROR " + e.getMessage());
                    return 6;
                }
            }
            try {
                client.connect();
            } catch (DeviceClient.Rollback rb) {   // a restarted device ahead of a server that resumed from a checkpoint
                System.err.println(rb.getMessage());
            }
            long total = (long) batchesPerEpoch * epochs;
            while (client.committed() < total) {
                long id = client.committed() + 1;
                int start = (int) ((id - 1) % batchesPerEpoch) * batch, n = Math.min(batch, shape[0] - start);
                float[] x = new float[n * plane];
                System.arraycopy(images, start * plane, x, 0, n * plane);
                int[] y = new int[n];
                long[] ids = new long[n];
                for (int j = 0; j < n; j++) { y[j] = labels[start + j]; ids[j] = start + j; }
                try {
                    System.out.println(client.trainBatch(id, x, new int[] {n, shape[1], shape[2], shape[3]}, y, ids).toJson());
                    if (weightsOut != null) appendWeights(weightsOut, id, layer);
                } catch (DeviceClient.Rollback rb) {
                    System.err.println(rb.getMessage());
                }
            }
            return 0;
        } catch (RemoteError | BudgetGuard.BudgetExceeded | Transport.ConnectionLost | UntrustedServer
                 | BudgetGuard.LostState e) {
            return stopped(e);
        }
    }

    /** The exit status of a run that stopped on `e`, with its reason on stderr. */
    static int stopped(Exception e) {
        if (e instanceof BudgetGuard.BudgetExceeded) {
            System.err.println("STOPPED privacy budget spent: " + e.getMessage());
            return 3;
        }
        System.err.println("ERROR " + e.getMessage());
        if (e instanceof RemoteError) return 2;
        if (e instanceof Transport.ConnectionLost) return 4;
        if (e instanceof UntrustedServer) return 5;
        if (e instanceof BudgetGuard.LostState || e instanceof BudgetGuard.StateFileError) return 6;
        if (e instanceof AppBundle.Invalid) return 65;
        throw new IllegalStateException("no exit status for " + e, e);
    }

    /** The options of `train` and `app`: --ca-file, --insecure, --max-message-bytes, and the TLS they make for `url`. */
    record Connection(Tls tls, long maxMessageBytes) {
        static Connection parse(String url, String[] options) {
            Path caFile = null;
            boolean insecure = false;
            long maxMessageBytes = Messages.DEFAULT_MAX_MESSAGE_BYTES;
            for (int j = 0; j < options.length; j++) {
                switch (options[j]) {
                    case "--ca-file": caFile = Path.of(value(options, ++j)); break;
                    case "--insecure": insecure = true; break;
                    case "--max-message-bytes": maxMessageBytes = Long.parseLong(value(options, ++j)); break;
                    default: throw new IllegalArgumentException("unknown option " + options[j] + "; " + USAGE);
                }
            }
            return new Connection(Tls.forUrl(url, caFile, insecure), maxMessageBytes);
        }
    }

    /**
     * `app DIR DEVICE`: the app's run ({@link AppRun}) on the folder of splitface-export --app, as the Activity runs
     * it, with what the phone's user and its storage give in DEVICE (msgpack): "library" (libsplitface_jni),
     * "device_id", "token", "url" (else the job's), "images" (uint8 NCHW), "shape", "labels", optional "state_dir"
     * and "weights_out" (as `train`). A JVM has no battery: every batch's energy is "not reported". Exit status as
     * `train`, and 65 for a folder that does not match its manifest or whose programs do not fit its layer.
     */
    @SuppressWarnings("unchecked")
    static int app(Path dir, Map<String, Object> device, String[] options) throws Exception {
        AppBundle bundle;
        String url;
        Connection connection;
        try {
            bundle = AppBundle.load(dir);
            url = bundle.url((String) device.get("url"));
        } catch (AppBundle.Invalid e) {
            return stopped(e);
        }
        try {
            connection = Connection.parse(url, options);
        } catch (IllegalArgumentException e) {
            System.err.println("ERROR " + e.getMessage());
            return 64;
        }
        NativeProgram.loadLibrary(Path.of((String) device.get("library")));
        int[] shape = ints((List<?>) device.get("shape"));
        byte[] pixels = (byte[]) device.get("images");
        int[] labels = ints((List<?>) device.get("labels"));
        AppRun.Faces faces = new AppRun.Faces() {
            @Override public int count() { return shape[0]; }
            @Override public int label(int index) { return labels[index]; }
            @Override public float[] image(int index, int size) {
                if (shape[2] != size || shape[3] != size)
                    throw new IllegalArgumentException("images of " + shape[2] + " x " + shape[3]
                            + ", the job takes " + size);
                int plane = shape[1] * size * size;
                return pixels(Arrays.copyOfRange(pixels, index * plane, (index + 1) * plane));
            }
        };
        Path stateDir = device.get("state_dir") == null ? null : Path.of((String) device.get("state_dir"));
        Path weightsOut = device.get("weights_out") == null ? null : Path.of((String) device.get("weights_out"));
        if (weightsOut != null) Files.write(weightsOut, new byte[0]);
        BatteryCounters none = () -> new BatteryCounters.Reading(System.nanoTime(), null, null, null, null, false);
        try (EnergyMeter meter = new EnergyMeter(none, 0);
             AppRun run = new AppRun(bundle, faces, false, url, (String) device.get("device_id"),
                     (String) device.get("token"), JdkWebSocketTransport.factory(connection.tls), stateDir, meter,
                     connection.maxMessageBytes)) {
            run.connect();
            while (!run.done()) {
                AppRun.Batch batch = run.next();
                if (batch == null) continue;   // rolled back to the server's checkpoint
                System.out.println(batch.toJson());
                System.err.println(batch.describe());
                if (weightsOut != null) appendWeights(weightsOut, batch.metrics().batchId(), run.layer);
            }
            return 0;
        } catch (RemoteError | BudgetGuard.BudgetExceeded | Transport.ConnectionLost | UntrustedServer
                 | BudgetGuard.LostState | BudgetGuard.StateFileError | AppBundle.Invalid e) {
            return stopped(e);
        }
    }

    /** The layer after batch `id`'s step: what the SGD of every trainer here updates (their weights live in Java). */
    static void appendWeights(Path out, long id, DeviceLayer layer) throws java.io.IOException {
        float[] bias = layer.bias == null ? new float[0] : layer.bias;
        ByteBuffer buf = ByteBuffer.allocate(8 + 4 * (layer.weight.length + bias.length)).order(ByteOrder.LITTLE_ENDIAN);
        buf.putLong(id);
        for (float v : layer.weight) buf.putFloat(v);
        for (float v : bias) buf.putFloat(v);
        Files.write(out, buf.array(), java.nio.file.StandardOpenOption.APPEND);
    }

    private static String value(String[] options, int j) {
        if (j >= options.length) throw new IllegalArgumentException(options[j - 1] + " needs a value; " + USAGE);
        return options[j];
    }

    static float[] floats(byte[] b) {
        ByteBuffer buf = ByteBuffer.wrap(b).order(ByteOrder.LITTLE_ENDIAN);
        float[] out = new float[b.length / 4];
        for (int j = 0; j < out.length; j++) out[j] = buf.getFloat();
        return out;
    }

    static byte[] bytes(float[] f) {
        ByteBuffer buf = ByteBuffer.allocate(f.length * 4).order(ByteOrder.LITTLE_ENDIAN);
        for (float v : f) buf.putFloat(v);
        return buf.array();
    }

    static int[] ints(List<?> list) {
        int[] out = new int[list.size()];
        for (int j = 0; j < out.length; j++) out[j] = i(list.get(j));
        return out;
    }

    static int i(Object o) { return (int) ((Number) o).longValue(); }

    static double d(Object o) { return ((Number) o).doubleValue(); }
}
