package org.splitface.core;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;

/**
 * A device's training progress on disk, beside its budget state (as splitface/device/progress.py): the last batch it
 * committed and its layer snapshots back to the server's durable_through (SPEC.md section 11), so that an app killed
 * mid-epoch and restarted rejoins the same server run where it stopped, with the same batches. Without it a restarted
 * device begins again at batch 0 and cannot reconcile with a server that applied its later batches. One file per
 * device id, written whole and checksummed ({@link StateFile}) after every commit; a file that fails its checks, or
 * belongs to another device, model or split, is an error ({@link BudgetGuard.StateFileError}), never a fresh start.
 */
public final class TrainingState {
    static final String FORMAT = "splitface-jvm-training-state";
    static final String WHAT = "training state";

    /** What a file holds: the committed batch and its snapshots, by batch id. */
    public static final class Progress {
        public final long committed;
        public final TreeMap<Long, Object> snapshots;
        Progress(long committed, TreeMap<Long, Object> snapshots) { this.committed = committed; this.snapshots = snapshots; }
    }

    public final Path file;
    private final byte[] identity;   // msgpack of {device_id, model, split, head, num_classes}: what the state is for

    public TrainingState(Path file, ClientSession session) {
        this.file = file;
        Map<String, Object> id = new LinkedHashMap<>();
        id.put("device_id", session.deviceId);
        id.put("model", session.model);
        id.put("split", session.split);
        id.put("head", session.head);
        id.put("num_classes", session.numClasses == null ? null : (long) session.numClasses);
        this.identity = Wire.pack(id);
    }

    /** Where a device keeps its training state in {@code dir}. */
    public static Path stateFile(Path dir, String deviceId) { return StateFile.path(dir, deviceId, "training"); }

    /** The progress on disk, or null if this device has none yet. */
    @SuppressWarnings("unchecked")
    public Progress load() {
        if (!Files.exists(file)) return null;
        Map<String, Object> state = (Map<String, Object>) Wire.unpack(StateFile.read(file, FORMAT, WHAT));
        if (!(state.get("identity") instanceof byte[]) || !Arrays.equals(identity, (byte[]) state.get("identity")))
            throw new BudgetGuard.StateFileError(file + ": training state of " + Wire.unpack((byte[]) state.get("identity"))
                    + ", not of this device's " + Wire.unpack(identity) + "; refusing to train");
        TreeMap<Long, Object> snapshots = new TreeMap<>();
        for (Object pair : (List<Object>) state.get("snapshots")) {
            List<Object> p = (List<Object>) pair;
            snapshots.put((Long) p.get(0), decode(p.get(1)));
        }
        long committed = (Long) state.get("committed");
        if (!snapshots.containsKey(committed))
            throw new BudgetGuard.StateFileError(file + ": no snapshot of the committed batch " + committed + "; refusing to train");
        return new Progress(committed, snapshots);
    }

    /** Make {@code committed} and exactly these snapshots durable (atomic: the old file or the new one). */
    public void save(long committed, TreeMap<Long, Object> snapshots) {
        List<Object> pairs = new ArrayList<>();
        for (Map.Entry<Long, Object> e : snapshots.entrySet()) pairs.add(List.of(e.getKey(), encode(e.getValue())));
        Map<String, Object> state = new LinkedHashMap<>();
        state.put("identity", identity);
        state.put("committed", committed);
        state.put("snapshots", pairs);
        StateFile.write(file, FORMAT, Wire.pack(state), WHAT);
    }

    /** A trainer's snapshot (Object[] / float[][] / float[] / numbers / null) as msgpack values. */
    static Object encode(Object v) {
        if (v == null || v instanceof Long || v instanceof Double || v instanceof String || v instanceof Boolean) return v;
        if (v instanceof float[]) {
            float[] f = (float[]) v;
            ByteBuffer b = ByteBuffer.allocate(4 * f.length).order(ByteOrder.LITTLE_ENDIAN);
            for (float x : f) b.putFloat(x);
            return Map.of("f32", b.array());
        }
        if (v instanceof float[][]) {
            List<Object> rows = new ArrayList<>();
            for (float[] row : (float[][]) v) rows.add(encode(row));
            return Map.of("f32s", rows);
        }
        if (v instanceof Object[]) {
            List<Object> items = new ArrayList<>();
            for (Object x : (Object[]) v) items.add(encode(x));
            return items;
        }
        throw new IllegalArgumentException("a " + v.getClass().getSimpleName() + " in a layer snapshot cannot be saved");
    }

    @SuppressWarnings("unchecked")
    static Object decode(Object v) {
        if (v instanceof List) {
            List<Object> items = (List<Object>) v;
            Object[] out = new Object[items.size()];
            for (int i = 0; i < out.length; i++) out[i] = decode(items.get(i));
            return out;
        }
        if (v instanceof Map && ((Map<?, ?>) v).containsKey("f32")) {
            ByteBuffer b = ByteBuffer.wrap((byte[]) ((Map<?, ?>) v).get("f32")).order(ByteOrder.LITTLE_ENDIAN);
            float[] f = new float[b.remaining() / 4];
            for (int i = 0; i < f.length; i++) f[i] = b.getFloat();
            return f;
        }
        if (v instanceof Map && ((Map<?, ?>) v).containsKey("f32s")) {
            List<Object> rows = (List<Object>) ((Map<?, ?>) v).get("f32s");
            float[][] out = new float[rows.size()][];
            for (int i = 0; i < out.length; i++) out[i] = (float[]) decode(rows.get(i));
            return out;
        }
        return v;
    }
}
