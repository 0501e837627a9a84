package org.splitface.core;

import java.nio.file.Path;
import java.util.Locale;
import java.util.Random;

/**
 * The app's training run on an {@link AppBundle}: the strip trainer (JNI) from the exported layer, the job's noise,
 * budget and SGD, the durable budget and progress in the app's private folder, the batches of the phone's photos,
 * and each batch's latency and energy ({@link EnergyMeter}). The Activity only supplies the photos, the battery's
 * counters and a websocket; every decision is here, where the host JVM tests it ({@code Cli app}).
 */
public final class AppRun implements AutoCloseable {
    /** The phone's photos: FaceFolder in the app (decoded from JPEG), a msgpack of images in the tests. */
    public interface Faces {
        int count();

        /** The label index of photo `index` in the server's classes. */
        int label(int index);

        /** Photo `index` as CHW floats in [0, 1], `size` x `size`. */
        float[] image(int index, int size);
    }

    /** One batch: what it cost in time and bytes, and the battery's measure of it. */
    public record Batch(BatchMetrics metrics, BatchEnergy energy) {
        /** The line the app shows. */
        public String describe() {
            BatchMetrics m = metrics;
            return String.format(Locale.ROOT, "#%d  device %.0f ms (release %.0f, step %.0f)  round trip %.0f ms  "
                            + "up %.2f MB down %.2f MB  loss %.3f  %s%s", m.batchId(), m.forwardMs() + m.backwardMs(),
                    m.forwardMs(), m.backwardMs(), m.roundTripMs(), m.bytesUp() / 1e6, m.bytesDown() / 1e6, m.loss(),
                    energy.describe(), Double.isNaN(m.epsilonLeft()) ? ""
                            : String.format(Locale.ROOT, "  eps %.3g left %.3g", m.epsilonSpent(), m.epsilonLeft()));
        }

        /** Cli's JSON line: BatchMetrics' keys (energy_mah from the battery), then energy_mj, its source, charging. */
        public String toJson() {
            String json = metrics.toJson(), e = energy.toJson();
            return json.substring(0, json.length() - 1) + ", " + e.substring(e.indexOf("\"energy_mj\""));
        }
    }

    public final AppBundle bundle;
    public final DeviceLayer layer;
    private final Faces faces;
    private final int[] order;
    private final StripLayerTrainer trainer;
    private final DeviceClient client;
    private final EnergyMeter meter;
    private final long total;

    /**
     * url: from {@link AppBundle#url}; stateDir: where the budget and the progress are kept (null: in memory);
     * shuffle: visit the photos in a fixed random order (a folder per person would make single-person batches);
     * libsplitface_jni must be loaded.
     */
    public AppRun(AppBundle bundle, Faces faces, boolean shuffle, String url, String deviceId, String token,
                  Transport.Factory transports, Path stateDir, EnergyMeter meter, long maxMessageBytes) {
        if (faces.count() == 0) throw new IllegalArgumentException("no photos to train on");
        this.bundle = bundle; this.faces = faces; this.meter = meter;
        order = new int[faces.count()];
        for (int j = 0; j < order.length; j++) order[j] = j;
        if (shuffle) {   // fixed seed: a restarted app sends the same images under the same batch id
            Random random = new Random(0);
            for (int j = order.length - 1; j > 0; j--) {
                int k = random.nextInt(j + 1), t = order[j];
                order[j] = order[k]; order[k] = t;
            }
        }
        layer = bundle.layer();
        Sgd sgd = bundle.sgd(layer, order.length);
        total = (long) bundle.batchesPerEpoch(order.length) * bundle.epochs;
        ClientSession session = bundle.session(deviceId, token);
        trainer = bundle.trainer(layer, sgd);   // first: programs that do not fit stop the run before any state is written
        try {
            BudgetGuard guard = bundle.guard();
            if (guard != null && stateDir != null)   // durable: a restarted app resumes its spent epsilon, never 0
                guard.persistIn(BudgetGuard.stateFile(stateDir, deviceId), deviceId);
            client = new DeviceClient(url, transports, session, trainer, bundle.noise(), guard, 120_000, 10, maxMessageBytes);
            if (stateDir != null) client.persistIn(new TrainingState(TrainingState.stateFile(stateDir, deviceId), session));
        } catch (RuntimeException e) {
            trainer.close();
            throw e;
        }
    }

    /** HELLO/WELCOME; a server that resumed from an older checkpoint rolls the layer back first. */
    public void connect() throws Transport.ConnectionLost {
        try {
            client.connect();
        } catch (DeviceClient.Rollback rb) {
            // the layer is the checkpoint's; training continues from committed() + 1
        }
    }

    public long committed() { return client.committed(); }

    /** The job's batches: its epochs over the photos. */
    public long total() { return total; }

    public boolean done() { return client.committed() >= total; }

    /** Trains the next batch; null when the server rolled the run back instead (continue with the next call). */
    public Batch next() throws Transport.ConnectionLost {
        long id = client.committed() + 1;
        int per = bundle.batchesPerEpoch(order.length), size = bundle.inputSize;
        int start = (int) ((id - 1) % per) * bundle.batchSize, n = Math.min(bundle.batchSize, order.length - start);
        int plane = 3 * size * size;
        float[] x = new float[n * plane];
        int[] y = new int[n];
        long[] ids = new long[n];
        for (int j = 0; j < n; j++) {
            int index = order[start + j];
            float[] image = faces.image(index, size);
            if (image.length != plane) throw new IllegalArgumentException("photo " + index + " has " + image.length
                    + " values, not 3 x " + size + " x " + size);
            System.arraycopy(image, 0, x, j * plane, plane);
            y[j] = faces.label(index);
            ids[j] = index;
        }
        meter.start();
        BatchMetrics m;
        try {
            m = client.trainBatch(id, x, new int[] {n, 3, size, size}, y, ids);
        } catch (DeviceClient.Rollback rb) {
            meter.stop();
            return null;
        } catch (RuntimeException | Transport.ConnectionLost e) {
            meter.stop();
            throw e;
        }
        BatchEnergy energy = meter.stop();
        return new Batch(new BatchMetrics(m.batchId(), m.forwardMs(), m.backwardMs(), m.roundTripMs(), m.serverMs(),
                m.bytesUp(), m.bytesDown(), m.loss(), m.nCorrect(), m.n(), m.epsilonSpent(), m.epsilonLeft(),
                energy.milliAmpHours()), energy);
    }

    @Override public void close() {
        try {
            client.close();
        } finally {
            trainer.close();
        }
    }
}
