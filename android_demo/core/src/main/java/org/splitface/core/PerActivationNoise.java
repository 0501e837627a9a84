package org.splitface.core;

import java.security.SecureRandom;
import java.util.Random;

/**
 * The source paper's mechanism: N(0, (S_f sigma)^2) on every activation, sigma = sqrt(2 ln(1.25/delta)) / epsilon
 * (splitface/device/privacy/mechanisms.py). What this means per image and per run is the Python accountant's
 * job; the device only enforces the schedule it computed ({@link BudgetGuard}).
 */
public final class PerActivationNoise {
    public static final double PAPER_LRN_SENSITIVITY = 1 / Math.sqrt(2);
    public final double epsilon, delta, sensitivity, sigma, std;
    private final Random random;

    public PerActivationNoise(double epsilon, double delta, Random random) {
        if (!(epsilon > 0) || !(delta > 0 && delta < 1)) throw new IllegalArgumentException("need epsilon > 0 and 0 < delta < 1");
        this.epsilon = epsilon; this.delta = delta; this.sensitivity = PAPER_LRN_SENSITIVITY;
        this.sigma = Math.sqrt(2 * Math.log(1.25 / delta)) / epsilon;
        this.std = sensitivity * sigma;
        this.random = random;
    }

    /** A CSPRNG by default: the server must not be able to predict (and subtract) the noise. */
    public PerActivationNoise(double epsilon, double delta) { this(epsilon, delta, new SecureRandom()); }

    public float[] noise(int n) {
        float[] out = new float[n];
        for (int i = 0; i < n; i++) out[i] = (float) (std * random.nextGaussian());
        return out;
    }
}
