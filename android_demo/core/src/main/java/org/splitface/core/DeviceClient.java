package org.splitface.core;

import java.util.Map;
import java.util.Set;
import java.util.TreeMap;

/**
 * A device training its layer against the edge server (server head), as splitface/device/connection.py:
 * one batch in flight; a lost connection is re-opened and the same bytes re-sent (the server
 * applies a batch once and replays its reply for a retry); after a server restart the device
 * rolls back to the server's checkpoint using the snapshots it keeps back to durable_through.
 * The layer changes only when BACKWARD arrives. A device with noise and a budget guard reports its
 * spent epsilon in every FORWARD and stops ({@link BudgetGuard.LostState}) if WELCOME says the server
 * recorded more for it than its own books hold (SPEC.md section 5.11). With {@link #persistIn} its committed batch
 * and snapshots are durable too ({@link TrainingState}), so a killed app restarted against the same server run
 * resumes where it stopped instead of beginning again at batch 0.
 */
public final class DeviceClient implements AutoCloseable {
    /** The server resumed from an older checkpoint: continue from batch {@code batchId + 1}. */
    public static final class Rollback extends RuntimeException {
        public final long batchId;
        Rollback(long batchId) { super("server resumed at batch " + batchId + "; rolled back"); this.batchId = batchId; }
    }

    private final String url;
    private final Transport.Factory transports;
    private final ClientSession session;
    private final LayerTrainer layer;
    private final PerActivationNoise noise;   // null: no noise (the server sees the activations)
    private final BudgetGuard guard;          // null: no budget
    private final long replyTimeoutMs;
    private final long maxMessageBytes;
    private final int reconnectAttempts;
    private TreeMap<Long, Object> snapshots = new TreeMap<>();
    private final Object initial;          // batch 0's state, which a server run with nothing of this device starts from
    private TrainingState state;           // null: progress in memory only
    private Transport transport;
    private long committed;
    private Long inFlight;                 // the training batch whose FORWARD is being sent and not yet answered

    /**
     * maxMessageBytes: the largest server message accepted (as splitface/device/connection.py: the spec's floor is 2^30,
     * raised to the server's announced limit if that is larger); the device never accepts unbounded messages.
     */
    public DeviceClient(String url, Transport.Factory transports, ClientSession session, LayerTrainer layer,
                        PerActivationNoise noise, BudgetGuard guard, long replyTimeoutMs, int reconnectAttempts,
                        long maxMessageBytes) {
        if (maxMessageBytes < 1) throw new IllegalArgumentException("max_message_bytes must be positive, not " + maxMessageBytes);
        this.maxMessageBytes = maxMessageBytes;
        this.url = url; this.transports = transports; this.session = session; this.layer = layer;
        this.noise = noise; this.guard = guard; this.replyTimeoutMs = replyTimeoutMs; this.reconnectAttempts = reconnectAttempts;
        initial = layer.snapshot();
        snapshots.put(0L, initial);
    }

    public long committed() { return committed; }

    /**
     * Keep the committed batch and the snapshots in {@code trainingState} from now on: resumed if its file exists
     * (the layer gets the committed batch's snapshot back; a bad or foreign file throws StateFileError), else written
     * at once. Call before the first batch.
     */
    public DeviceClient persistIn(TrainingState trainingState) {
        if (committed != 0) throw new IllegalStateException("open the training state before the first batch");
        TrainingState.Progress progress = trainingState.load();
        if (progress != null) {
            layer.restore(progress.snapshots.get(progress.committed));
            snapshots = progress.snapshots;
            committed = progress.committed;
        }
        state = trainingState;
        save();
        return this;
    }

    private void save() {
        if (state != null) state.save(committed, snapshots);
    }

    /**
     * HELLO / WELCOME; may throw Rollback (state already restored), RemoteError (e.g. a wrong token),
     * UntrustedServer (the server's certificate is refused) or BudgetGuard.LostState (this device's budget state
     * says less than the server's figure), none of which a retry would change.
     */
    public void connect() throws Transport.ConnectionLost {
        transport = transports.open(url, maxMessageBytes);
        transport.send(session.hello());
        Map<String, Object> welcome = session.acceptWelcome(transport.receive(replyTimeoutMs));
        transport.maxMessageBytes(Math.max(maxMessageBytes, session.maxMessageBytes()));
        if (guard != null) {
            try {
                Object figure = welcome.get("spent_epsilon");
                guard.checkServerFigure(session.deviceId, figure == null ? null : ((Number) figure).doubleValue());
            } catch (BudgetGuard.LostState e) {
                close();
                throw e;
            }
        }
        WelcomeDecision decision;
        try {
            decision = session.reconcile(committed, inFlight);
        } catch (WelcomeDecision.CannotResume e) {
            close();
            if (!"server_ahead".equals(e.reason))
                throw new IllegalStateException(e.detail + ": the server's WELCOME contradicts itself", e);
            throw new IllegalStateException(e.detail + ": the device lost its state (" + (state == null ? "it keeps no training state, so a restarted "
                    + "device begins again at batch 0" : "its training state " + state.file + " is older than the server's "
                    + "record") + "); it cannot rejoin this run", e);
        }
        forgetBefore(decision.forgetBefore);
        if (decision.kind == WelcomeDecision.Kind.ROLLBACK) {
            restore(decision.batchId);
            throw new Rollback(decision.batchId);
        }
    }

    private void reconnect() throws Transport.ConnectionLost {
        close();
        Transport.ConnectionLost last = null;
        for (int i = 0; i < reconnectAttempts; i++) {
            try {
                connect();
                return;
            } catch (Transport.ConnectionLost e) {
                last = e;
                try { Thread.sleep(Math.min(2000, 100L << i)); } catch (InterruptedException ie) { Thread.currentThread().interrupt(); }
            }
        }
        throw last;
    }

    /** One training batch; images NCHW in [0, 1]. Throws BudgetExceeded before sending anything over budget. */
    public BatchMetrics trainBatch(long batchId, float[] images, int[] shape, int[] labels, long[] imageIds)
            throws Transport.ConnectionLost {
        if (batchId != committed + 1) throw new IllegalArgumentException("next batch is " + (committed + 1));
        long t0 = System.nanoTime();
        float[] out = layer.forward(images, shape[0], shape[2], shape[3]);
        if (noise != null) {
            float[] z = noise.noise(out.length);
            for (int i = 0; i < out.length; i++) out[i] += z[i];
        }
        if (guard != null) guard.admit(imageIds);   // before anything is sent; a re-send below is the same release
        int[] outShape = layer.outputShape(shape[0], shape[2], shape[3]);
        Double spent = noise != null && guard != null ? guard.spent() : null;   // with this release counted
        byte[] forward = session.forward(batchId, out, outShape, labels, false, spent);
        double forwardMs = (System.nanoTime() - t0) / 1e6;

        long t1 = System.nanoTime();
        Map<String, Object> backward = null;
        int serverFailures = 0;
        long received = 0;
        inFlight = batchId;
        try {
            while (backward == null) {
                try {
                    transport.send(forward);
                    byte[] reply = transport.receive(replyTimeoutMs);
                    received = reply.length;
                    backward = session.receive(reply, Set.of(Messages.BACKWARD), batchId);
                } catch (Transport.ConnectionLost e) {
                    reconnect();   // may throw Rollback: the caller continues from committed() + 1
                } catch (RemoteError e) {
                    if (e.fatal() || !"server_error".equals(e.code) || ++serverFailures > 3) throw e;
                }
            }
        } finally {
            inFlight = null;
        }
        double roundTripMs = (System.nanoTime() - t1) / 1e6;

        long t2 = System.nanoTime();
        layer.step(((Tensor) backward.get("grad")).values());
        committed = batchId;
        snapshots.put(batchId, layer.snapshot());
        snapshots.headMap(Math.min((Long) backward.get("durable_through"), committed), false).clear();
        save();   // one write per batch: the step and what the server's checkpoint now covers
        double backwardMs = (System.nanoTime() - t2) / 1e6;

        Object serverS = backward.get("server_s");
        double epsilon = guard == null ? Double.POSITIVE_INFINITY : guard.spent();
        double left = guard == null ? Double.NaN : guard.budget - epsilon;
        if (noise == null) epsilon = Double.POSITIVE_INFINITY;
        return new BatchMetrics(batchId, forwardMs, backwardMs, roundTripMs,
                serverS == null ? null : ((Number) serverS).doubleValue() * 1e3, forward.length, received,
                ((Number) backward.get("loss")).doubleValue(), (int) (long) (Long) backward.get("n_correct"),
                labels.length, epsilon, left, null);
    }

    private void restore(long batchId) {
        if (batchId == 0) snapshots.putIfAbsent(0L, initial);
        Object s = snapshots.get(batchId);
        if (s == null) throw new IllegalStateException("cannot roll back to batch " + batchId + ": no snapshot");
        layer.restore(s);
        committed = batchId;
        snapshots.tailMap(batchId, false).clear();
        save();
    }

    private void forgetBefore(long durable) {
        var older = snapshots.headMap(Math.min(durable, committed), false);
        if (older.isEmpty()) return;
        older.clear();
        save();
    }

    @Override
    public void close() {
        if (transport != null) { transport.close(); transport = null; }
    }
}
