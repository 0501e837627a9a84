package org.splitface.core;

import java.util.HashMap;
import java.util.List;
import java.util.Map;

/**
 * Refuses a release that would take any image past its budget, before anything is sent. The
 * epsilon after k releases comes from a schedule the Python accountant (dp_accounting's PLD)
 * computed for this mechanism ({@code python -m device_sdk.privacy schedule}); the phone does no
 * composition of its own.
 */
public final class BudgetGuard {
    public static final class BudgetExceeded extends RuntimeException {
        public BudgetExceeded(String message) { super(message); }
    }

    private final double[] epsilonAfter;   // epsilonAfter[k - 1]: an image's epsilon after k releases
    public final double budget, delta;
    private final Map<Long, Integer> releases = new HashMap<>();

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

    /** Record one release of each image, or throw (recording nothing) if one would exceed the budget. */
    public void admit(long[] imageIds) {
        for (long id : imageIds) {
            int k = releases.getOrDefault(id, 0) + 1;
            if (epsilonAfter(k) > budget)
                throw new BudgetExceeded("release " + k + " of image " + id + " would reach epsilon " + epsilonAfter(k)
                        + " > budget " + budget + " (delta " + delta + "); nothing was sent");
        }
        for (long id : imageIds) releases.merge(id, 1, Integer::sum);
    }

    /** The largest epsilon any image has spent so far. */
    public double spent() {
        int most = releases.values().stream().mapToInt(Integer::intValue).max().orElse(0);
        return epsilonAfter(most);
    }
}
