package org.splitface.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertThrows;

import java.util.List;
import java.util.Map;
import java.util.Random;
import org.junit.Test;

public class PrivacyTest {
    @Test
    public void noiseHasThePaperScale() {
        PerActivationNoise n = new PerActivationNoise(3.0, 1e-5, new Random(0));
        assertEquals(Math.sqrt(2 * Math.log(1.25 / 1e-5)) / 3.0, n.sigma, 1e-12);
        float[] z = n.noise(200_000);
        double sum = 0, sq = 0;
        for (float v : z) { sum += v; sq += v * v; }
        double mean = sum / z.length, std = Math.sqrt(sq / z.length - mean * mean);
        assertEquals(0, mean, 0.01 * n.std);
        assertEquals(n.std, std, 0.01 * n.std);
    }

    @Test
    public void guardRefusesBeforeOverspendingAndRecordsNothing() {
        byte[] schedule = Wire.pack(Map.of("delta", 1e-5, "epsilon_after", List.of(1.0, 1.5, 1.9)));
        BudgetGuard g = BudgetGuard.fromSchedule(schedule, 1.6);
        g.admit(new long[] {1, 2});
        g.admit(new long[] {1});
        assertEquals(1.5, g.spent(), 0);
        assertThrows(BudgetGuard.BudgetExceeded.class, () -> g.admit(new long[] {2, 1}));
        g.admit(new long[] {2});   // the refused batch recorded nothing for image 2
        assertEquals(1.5, g.spent(), 0);
        BudgetGuard beyond = BudgetGuard.fromSchedule(schedule, 100);
        for (int i = 0; i < 3; i++) beyond.admit(new long[] {7});
        assertThrows(BudgetGuard.BudgetExceeded.class, () -> beyond.admit(new long[] {7}));  // past the schedule: unknown, refused
    }

    @Test
    public void halfPrecisionRoundTripsAndScalesLikeTheReference() {
        for (float v : new float[] {0f, 1f, -2.5f, 65504f, 6.1035156e-5f, 5.9604645e-8f, 0.1f})
            assertEquals(v, Half.toFloat(Half.fromFloat(v)), Math.abs(v) * 1e-3);
        float[] tiny = {3e-8f, -1.5e-8f, 0f};
        float[] back = Tensor.encode(tiny, new int[] {3}, "f16").values();
        for (int i = 0; i < 3; i++) assertEquals(tiny[i], back[i], 1e-3 * 3e-8);
    }
}
