package org.splitface.core;

import java.util.Locale;

/**
 * What one batch drew from the battery, as the phone's counters measured it: charge in mAh and energy in mJ, null
 * where the phone reports neither, and `source` saying which counters gave them. Never an estimate: a phone that
 * reports nothing gets "not reported by this phone", and readings while charging are the charger's, not shown.
 */
public record BatchEnergy(Double milliAmpHours, Double milliJoules, String source, boolean charging) {
    public static final String NOT_REPORTED = "not reported by this phone";
    public static final String CHARGING = "not measured while charging (the readings are the charger's)";

    /** What the app shows for this batch's energy. */
    public String describe() {
        if (charging) return "energy " + CHARGING;
        if (milliAmpHours == null && milliJoules == null) return "energy " + (source == null ? NOT_REPORTED : source);
        StringBuilder s = new StringBuilder("energy");
        if (milliJoules != null) s.append(String.format(Locale.ROOT, " %.1f mJ", milliJoules));
        if (milliAmpHours != null) s.append(String.format(Locale.ROOT, " %.4f mAh", milliAmpHours));
        return s.append(" (").append(source).append(")").toString();
    }

    public String toJson() {
        return String.format(Locale.ROOT, "{\"energy_mah\": %s, \"energy_mj\": %s, \"energy_source\": %s, \"charging\": %s}",
                num(milliAmpHours), num(milliJoules), source == null ? "null" : "\"" + source + "\"", charging);
    }

    private static String num(Double v) { return v == null ? "null" : String.format(Locale.ROOT, "%.6f", v); }
}
