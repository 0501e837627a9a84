package org.splitface.core;

/** What one batch cost the device; what the app shows per batch. Energy is null where unmeasured. */
public record BatchMetrics(long batchId, double forwardMs, double backwardMs, double roundTripMs, Double serverMs,
                           long bytesUp, long bytesDown, double loss, int nCorrect, int n, double epsilonSpent,
                           double epsilonLeft, Double energyMah) {
    public String toJson() {
        return String.format(java.util.Locale.ROOT,
                "{\"batch_id\": %d, \"forward_ms\": %.3f, \"backward_ms\": %.3f, \"round_trip_ms\": %.3f, "
                        + "\"server_ms\": %s, \"bytes_up\": %d, \"bytes_down\": %d, \"loss\": %.6f, \"n_correct\": %d, "
                        + "\"n\": %d, \"epsilon_spent\": %s, \"epsilon_left\": %s, \"energy_mah\": %s}",
                batchId, forwardMs, backwardMs, roundTripMs, serverMs == null ? "null" : String.format(java.util.Locale.ROOT, "%.3f", serverMs),
                bytesUp, bytesDown, loss, nCorrect, n, num(epsilonSpent), num(epsilonLeft),
                energyMah == null ? "null" : String.format(java.util.Locale.ROOT, "%.6f", energyMah));
    }

    private static String num(double v) {
        return Double.isFinite(v) ? String.format(java.util.Locale.ROOT, "%.9g", v) : (v > 0 ? "\"inf\"" : "\"-inf\"");
    }
}
