package org.splitface.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertTrue;

import java.util.ArrayDeque;
import java.util.Deque;
import java.util.List;
import org.junit.Test;

/**
 * The energy arithmetic on recorded sequences of BatteryManager readings, through the meter's own start / sample /
 * stop: the counters replay what a phone would have returned (raw values, Integer.MIN_VALUE where unsupported).
 */
public class EnergyMeterTest {
    private static final long MS = 1_000_000L, UNSUPPORTED = Integer.MIN_VALUE;

    /** The phone's raw answers, in order: {ms, CHARGE_COUNTER uAh, ENERGY_COUNTER nWh, CURRENT_NOW uA, mV, charging}. */
    private static BatchEnergy replay(long[]... raw) {
        Deque<BatteryCounters.Reading> readings = new ArrayDeque<>();
        for (long[] r : raw)
            readings.add(BatteryCounters.Reading.fromAndroid(r[0] * MS, r[1], r[2], r[3], (int) r[4], r[5] != 0));
        try (EnergyMeter meter = new EnergyMeter(readings::removeFirst, 0)) {
            meter.start();
            for (int k = 1; k < raw.length - 1; k++) meter.sample();
            BatchEnergy e = meter.stop();
            assertTrue("every reading consumed", readings.isEmpty());
            return e;
        }
    }

    @Test
    public void energyCounterDropIsTheEnergy() {
        // 2,000 nWh = 7.2 mJ; the charge from CURRENT_NOW: 500 mA over 0.4 s = 0.0556 mAh (energy stays the counter's)
        BatchEnergy e = replay(new long[] {0, 3_000_000, 11_000_000, -500_000, 3900, 0},
                new long[] {200, 3_000_000, 10_999_500, -500_000, 3900, 0},
                new long[] {400, 3_000_000, 10_998_000, -500_000, 3900, 0});
        assertEquals(7.2, e.milliJoules(), 1e-9);
        assertEquals(500.0 * 0.4 / 3600, e.milliAmpHours(), 1e-12);   // mA x s / 3600 = mAh
        assertEquals("ENERGY_COUNTER; CURRENT_NOW, 3 readings", e.source());
    }

    @Test
    public void currentIsIntegratedByTrapezoidsTimesItsVoltage() {
        // 300 mA then 500 mA then 500 mA (either sign), 4.0 V then 3.8 V, 1 s steps
        BatchEnergy e = replay(new long[] {0, UNSUPPORTED, UNSUPPORTED, 300_000, 4000, 0},
                new long[] {1000, UNSUPPORTED, UNSUPPORTED, -500_000, 3800, 0},
                new long[] {2000, UNSUPPORTED, UNSUPPORTED, 500_000, 3800, 0});
        double mAs = (300 + 500) / 2.0 + 500;                           // mA x s
        assertEquals(mAs / 3600, e.milliAmpHours(), 1e-12);
        double mJ = (300 * 4.0 + 500 * 3.8) / 2 + 500 * 3.8;             // mA x V x s = mJ
        assertEquals(mJ, e.milliJoules(), 1e-9);
        assertEquals("CURRENT_NOW x voltage, 3 readings", e.source());
        assertTrue(e.describe(), e.describe().contains("3450.0 mJ"));
    }

    @Test
    public void chargeCounterWithoutCurrent() {
        // CURRENT_NOW unsupported; the counter drops 120 uAh at 3.9 V then 3.7 V: 0.12 mAh, 120 x 3.8 nWh
        BatchEnergy e = replay(new long[] {0, 2_500_120, UNSUPPORTED, UNSUPPORTED, 3900, 0},
                new long[] {900, 2_500_000, UNSUPPORTED, UNSUPPORTED, 3700, 0});
        assertEquals(0.12, e.milliAmpHours(), 1e-12);
        assertEquals(0.12 * 3.8 * 3600, e.milliJoules(), 1e-9);   // mAh x V = mWh, x 3600 = mJ
        assertEquals("CHARGE_COUNTER x voltage", e.source());
        // without a voltage: the charge only
        e = replay(new long[] {0, 2_500_120, UNSUPPORTED, UNSUPPORTED, -1, 0}, new long[] {900, 2_500_000, UNSUPPORTED, UNSUPPORTED, -1, 0});
        assertEquals(0.12, e.milliAmpHours(), 1e-12);
        assertNull(e.milliJoules());
        assertEquals("CHARGE_COUNTER", e.source());
    }

    @Test
    public void aCounterThatDidNotMoveIsNotZero() {
        BatchEnergy e = replay(new long[] {0, 2_500_000, UNSUPPORTED, UNSUPPORTED, 3900, 0},
                new long[] {300, 2_500_000, UNSUPPORTED, UNSUPPORTED, 3900, 0});
        assertNull(e.milliAmpHours());
        assertNull(e.milliJoules());
        assertTrue(e.describe(), e.describe().contains("CHARGE_COUNTER did not fall over this batch"));
    }

    @Test
    public void aPhoneWithoutCountersReportsNothing() {
        // Integer.MIN_VALUE, Long.MIN_VALUE and 0 all mean "unsupported"; a lone CURRENT_NOW reading is no integral
        BatchEnergy e = replay(new long[] {0, UNSUPPORTED, Long.MIN_VALUE, 0, 3900, 0},
                new long[] {500, 0, Long.MIN_VALUE, 0, 3900, 0});
        assertNull(e.milliAmpHours());
        assertNull(e.milliJoules());
        assertFalse(e.charging());
        assertEquals("energy not reported by this phone", e.describe());
        assertEquals("{\"energy_mah\": null, \"energy_mj\": null, \"energy_source\": null, \"charging\": false}", e.toJson());
        // one of several readings lacking CURRENT_NOW: no integral over a gap
        e = replay(new long[] {0, UNSUPPORTED, UNSUPPORTED, 400_000, 3900, 0}, new long[] {200, UNSUPPORTED, UNSUPPORTED, 0, 3900, 0},
                new long[] {400, UNSUPPORTED, UNSUPPORTED, 400_000, 3900, 0});
        assertEquals("energy not reported by this phone", e.describe());
    }

    @Test
    public void whileChargingNothingIsMeasured() {
        BatchEnergy e = replay(new long[] {0, 2_500_000, 11_000_000, -500_000, 3900, 0},
                new long[] {200, 2_500_100, 11_000_400, 800_000, 4100, 1},
                new long[] {400, 2_500_000, 10_999_000, -500_000, 3900, 0});
        assertTrue(e.charging());
        assertNull(e.milliAmpHours());
        assertNull(e.milliJoules());
        assertEquals("energy " + BatchEnergy.CHARGING, e.describe());
    }

    @Test
    public void theSamplerReadsDuringTheBatch() throws Exception {
        // a real sampler thread on a live counter source: at least the start, one sample and the stop
        List<Long> reads = new java.util.concurrent.CopyOnWriteArrayList<>();
        BatteryCounters live = () -> {
            long t = System.nanoTime();
            reads.add(t);
            return new BatteryCounters.Reading(t, null, null, 250_000L, 3800, false);
        };
        try (EnergyMeter meter = new EnergyMeter(live, 20)) {
            meter.start();
            Thread.sleep(150);
            BatchEnergy e = meter.stop();
            assertTrue(reads.size() >= 3);
            double seconds = (reads.get(reads.size() - 1) - reads.get(0)) / 1e9;
            assertEquals(250 * seconds / 3600, e.milliAmpHours(), 1e-9);
        }
    }
}
