package org.splitface.core;

/**
 * Where the battery's counters come from: the app reads Android's BatteryManager, a test replays a recorded
 * sequence of readings. {@link EnergyMeter} does all the arithmetic on them, so the host JVM tests it.
 */
public interface BatteryCounters {
    /** One reading of every counter now (null fields: not reported by this phone). */
    Reading read();

    /**
     * One reading. chargeMicroAh: BATTERY_PROPERTY_CHARGE_COUNTER (charge left, uAh); energyNanoWh:
     * BATTERY_PROPERTY_ENERGY_COUNTER (energy left, nWh); currentMicroA: BATTERY_PROPERTY_CURRENT_NOW (uA; its sign
     * differs between phones); voltageMillivolts: ACTION_BATTERY_CHANGED's EXTRA_VOLTAGE; charging: plugged in.
     */
    record Reading(long nanos, Long chargeMicroAh, Long energyNanoWh, Long currentMicroA, Integer voltageMillivolts,
                   boolean charging) {
        /**
         * From BatteryManager's raw values: Integer.MIN_VALUE or Long.MIN_VALUE is "unsupported" (its documented
         * answer), and so is 0, which phones without the counter also return (a live battery never reads 0 uAh
         * left, and a 0 current would be a phone drawing nothing); a voltage of 0 or less is none.
         */
        public static Reading fromAndroid(long nanos, long chargeCounter, long energyCounter, long currentNow,
                                          int voltageMillivolts, boolean charging) {
            return new Reading(nanos, reported(chargeCounter), reported(energyCounter), reported(currentNow),
                    voltageMillivolts > 0 ? voltageMillivolts : null, charging);
        }

        private static Long reported(long v) {
            return v == Long.MIN_VALUE || v == Integer.MIN_VALUE || v == 0 ? null : v;
        }
    }
}
