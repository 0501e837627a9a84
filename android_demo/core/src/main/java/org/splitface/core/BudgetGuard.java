package org.splitface.core;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;

/**
 * Refuses a release that would take any image past its budget, before anything is sent. The
 * epsilon after k releases comes from a schedule the Python accountant (dp_accounting's PLD)
 * computed for this mechanism ({@code splitface-device schedule}); the phone does no
 * composition of its own.
 *
 * <p>With {@link #persistIn} the releases are durable (as splitface/device/privacy/state.py): one file per
 * device id, written whole (temp file, fsync, atomic rename, fsync of the folder) with a SHA-256 of
 * its content, before a release is admitted; a restarted app resumes from it. A file that cannot be
 * trusted is an error, never a reason to start at epsilon 0, and a device whose books say less than
 * the server's last figure for it (WELCOME's spent_epsilon) stops: {@link LostState}.
 */
public final class BudgetGuard {
    public static final class BudgetExceeded extends RuntimeException {
        public BudgetExceeded(String message) { super(message); }
    }

    /** The budget state file is unreadable, corrupt, edited, for another device, or was lost: do not release. */
    public static final class StateFileError extends RuntimeException {
        public StateFileError(String message) { super(message); }
    }

    /** The server recorded more spent epsilon for this device than its state holds (SPEC.md section 5.11). */
    public static final class LostState extends RuntimeException {
        public LostState(String message) { super(message); }
    }

    static final String FORMAT = "splitface-jvm-budget-state";

    private final double[] epsilonAfter;   // epsilonAfter[k - 1]: an image's epsilon after k releases
    public final double budget, delta;
    private Map<Long, Integer> releases = new HashMap<>();
    private Path stateFile;     // null: in memory only
    private String deviceId;

    public BudgetGuard(double[] epsilonAfter, double budget, double delta) {
        this.epsilonAfter = epsilonAfter.clone(); this.budget = budget; this.delta = delta;
    }

    /** From the msgpack schedule: {"delta": d, "epsilon_after": [e_1, e_2, ...], ...}. */
    public static BudgetGuard fromSchedule(byte[] msgpack, double budget) {
        Map<?, ?> m = (Map<?, ?>) Wire.unpack(msgpack);
        List<?> eps = (List<?>) m.get("epsilon_after");
        double[] e = new double[eps.size()];
        for (int i = 0; i < e.length; i++) e[i] = ((Number) eps.get(i)).doubleValue();
        return new BudgetGuard(e, budget, ((Number) m.get("delta")).doubleValue());
    }

    private double epsilonAfter(int k) {
        return k == 0 ? 0 : k <= epsilonAfter.length ? epsilonAfter[k - 1] : Double.POSITIVE_INFINITY;
    }

    /**
     * Record one release of each image, or throw (recording nothing) if one would exceed the budget. With a state
     * file the new books are on disk before this returns, so before the release can be sent.
     */
    public void admit(long[] imageIds) {
        for (long id : imageIds) {
            int k = releases.getOrDefault(id, 0) + 1;
            if (epsilonAfter(k) > budget)
                throw new BudgetExceeded("release " + k + " of image " + id + " would reach epsilon " + epsilonAfter(k)
                        + " > budget " + budget + " (delta " + delta + "); nothing was sent");
        }
        Map<Long, Integer> next = new HashMap<>(releases);
        for (long id : imageIds) next.merge(id, 1, Integer::sum);
        if (stateFile != null) write(stateFile, deviceId, delta, next);
        releases = next;
    }

    /** Where a device keeps its budget state in {@code dir}. */
    public static Path stateFile(Path dir, String deviceId) {
        return StateFile.path(dir, deviceId, "budget");
    }

    /**
     * Keep this guard's releases in {@code file} from now on: resumed if it exists (a corrupt or foreign file throws
     * StateFileError), else written at once. Call before the first release.
     */
    public BudgetGuard persistIn(Path file, String deviceId) {
        if (!releases.isEmpty()) throw new IllegalStateException("open the state before the first release");
        if (Files.exists(file)) releases = read(file, deviceId, delta);
        else write(file, deviceId, delta, releases);
        this.stateFile = file;
        this.deviceId = deviceId;
        return this;
    }

    public Path stateFile() { return stateFile; }

    /** Stop (LostState) if the server's last figure for this device (WELCOME's spent_epsilon; null: none) exceeds ours. */
    public void checkServerFigure(String deviceId, Double serverFigure) {
        if (serverFigure == null || spent() >= serverFigure) return;
        String where = stateFile != null ? "budget state " + stateFile : "no budget state file";
        throw new LostState(deviceId + ": " + where + " says epsilon " + spent() + " spent, but the server recorded "
                + serverFigure + " for this device: the state was lost or replaced by an older copy. Refusing to start: "
                + "restore the file (never delete it to reset), or retire this device id");
    }

    /** The state as msgpack: {device_id, delta, releases: [[image id, count], ...] by image id}. */
    static byte[] encodeState(String deviceId, double delta, Map<Long, Integer> releases) {
        List<Object> pairs = new ArrayList<>();
        for (Map.Entry<Long, Integer> e : new TreeMap<>(releases).entrySet()) pairs.add(List.of(e.getKey(), (long) e.getValue()));
        Map<String, Object> state = new LinkedHashMap<>();
        state.put("device_id", deviceId);
        state.put("delta", delta);
        state.put("releases", pairs);
        return Wire.pack(state);
    }

    /** Written whole, checksummed (StateFile). */
    static void write(Path file, String deviceId, double delta, Map<Long, Integer> releases) {
        StateFile.write(file, FORMAT, encodeState(deviceId, delta, releases), "budget state");
    }

    @SuppressWarnings("unchecked")
    static Map<Long, Integer> read(Path file, String deviceId, double delta) {
        Map<String, Object> state = (Map<String, Object>) Wire.unpack(StateFile.read(file, FORMAT, "budget state"));
        if (!deviceId.equals(state.get("device_id")))
            throw new StateFileError(file + ": budget state of device '" + state.get("device_id") + "', not '" + deviceId + "'");
        if (!(state.get("delta") instanceof Double) || (Double) state.get("delta") != delta)
            throw new StateFileError(file + ": accounted at delta " + state.get("delta") + ", this run asks " + delta);
        Map<Long, Integer> releases = new HashMap<>();
        for (Object pair : (List<Object>) state.get("releases")) {
            List<Object> p = (List<Object>) pair;
            releases.put((Long) p.get(0), (int) (long) (Long) p.get(1));
        }
        return releases;
    }

    /** The largest epsilon any image has spent so far. */
    public double spent() {
        int most = releases.values().stream().mapToInt(Integer::intValue).max().orElse(0);
        return epsilonAfter(most);
    }
}
