package org.splitface.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;

import java.util.Random;
import org.junit.Test;

/** The Java device layer's backward against finite differences, and its output bound. */
public class DeviceLayerTest {
    static DeviceLayer layer(Double clamp) {
        DeviceLayer l = new DeviceLayer(3, 6, 3, 1, 1, true, 5, 1.0, 0.5, 2.0, clamp);
        Random r = new Random(1);
        for (int i = 0; i < l.weight.length; i++) l.weight[i] = (float) (r.nextGaussian() * 0.5);
        for (int i = 0; i < l.bias.length; i++) l.bias[i] = (float) (r.nextGaussian() * 0.1);
        return l;
    }

    static double loss(DeviceLayer l, float[] x, float[] g) {
        float[] y = l.forward(x, 2, 5, 5);
        double s = 0;
        for (int i = 0; i < y.length; i++) s += (double) y[i] * g[i];
        return s;
    }

    @Test
    public void backwardMatchesFiniteDifferences() {
        for (Double clamp : new Double[] {null, 1.0}) {
            DeviceLayer l = layer(clamp);
            Random r = new Random(2);
            float[] x = new float[2 * 3 * 25], g = new float[2 * 6 * 25];
            for (int i = 0; i < x.length; i++) x[i] = r.nextFloat();
            for (int i = 0; i < g.length; i++) g[i] = (float) r.nextGaussian();
            l.forward(x, 2, 5, 5);
            float[][] grads = l.backward(g);
            for (int p = 0; p < 2; p++) {
                float[] w = p == 0 ? l.weight : l.bias;
                for (int i = 0; i < w.length; i += 7) {
                    float keep = w[i];
                    double eps = 1e-3;
                    w[i] = (float) (keep + eps);
                    double up = loss(l, x, g);
                    w[i] = (float) (keep - eps);
                    double down = loss(l, x, g);
                    w[i] = keep;
                    double numeric = (up - down) / (2 * eps);
                    assertEquals("param " + p + "[" + i + "] clamp " + clamp, numeric, grads[p][i], 1e-2 * Math.max(1, Math.abs(numeric)));
                }
            }
        }
    }

    @Test
    public void outputsStayBelowThePaperBound() {
        DeviceLayer l = layer(1.0);
        float[] x = new float[2 * 3 * 25];
        java.util.Arrays.fill(x, 1f);
        for (float v : l.forward(x, 2, 5, 5)) assertTrue(v >= 0 && v < PerActivationNoise.PAPER_LRN_SENSITIVITY);
    }
}
