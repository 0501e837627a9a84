package org.splitface.core;

/**
 * The device layer in plain Java: conv (k x k, stride, zero padding, optional bias) + ReLU + the
 * source paper's LRN b_i = a_i / (gamma + alpha * sum_{|j-i| <= u/2} a_j^2)^beta, with the optional
 * clamp of LRN inputs to [0, inputMax] that the per-activation mechanism needs. A reference for
 * tests and for phones without ExecuTorch; backward gives the weight gradient of sum(out * grad).
 * Tensors are NCHW float arrays.
 */
public final class DeviceLayer {
    public final int cin, cout, k, stride, pad, size;
    public final double alpha, beta, gamma;
    public final Double inputMax;
    public final float[] weight;   // [cout, cin, k, k]
    public final float[] bias;     // [cout] or null
    private float[] x, z, a, d;    // cached by forward for backward
    private int n, h, w, ho, wo;

    public DeviceLayer(int cin, int cout, int k, int stride, int pad, boolean hasBias, int size, double alpha,
                       double beta, double gamma, Double inputMax) {
        this.cin = cin; this.cout = cout; this.k = k; this.stride = stride; this.pad = pad; this.size = size;
        this.alpha = alpha; this.beta = beta; this.gamma = gamma; this.inputMax = inputMax;
        this.weight = new float[cout * cin * k * k];
        this.bias = hasBias ? new float[cout] : null;
    }

    public int[] outputShape(int n, int h, int w) {
        return new int[] {n, cout, (h + 2 * pad - k) / stride + 1, (w + 2 * pad - k) / stride + 1};
    }

    public float[] forward(float[] input, int n, int h, int w) {
        this.n = n; this.h = h; this.w = w; this.x = input;
        int[] s = outputShape(n, h, w);
        ho = s[2]; wo = s[3];
        int plane = ho * wo;
        z = new float[n * cout * plane];
        for (int b = 0; b < n; b++)
            for (int o = 0; o < cout; o++) {
                int zoff = (b * cout + o) * plane;
                float b0 = bias == null ? 0f : bias[o];
                for (int i = 0; i < plane; i++) z[zoff + i] = b0;
                for (int c = 0; c < cin; c++) {
                    int xoff = (b * cin + c) * h * w;
                    for (int ky = 0; ky < k; ky++)
                        for (int kx = 0; kx < k; kx++) {
                            float wv = weight[((o * cin + c) * k + ky) * k + kx];
                            for (int y = 0; y < ho; y++) {
                                int iy = y * stride + ky - pad;
                                if (iy < 0 || iy >= h) continue;
                                for (int xx = 0; xx < wo; xx++) {
                                    int ix = xx * stride + kx - pad;
                                    if (ix >= 0 && ix < w) z[zoff + y * wo + xx] += wv * input[xoff + iy * w + ix];
                                }
                            }
                        }
                }
            }
        a = new float[z.length];
        for (int i = 0; i < z.length; i++) {
            float v = Math.max(z[i], 0f);
            a[i] = inputMax == null ? v : Math.min(v, (float) (double) inputMax);
        }
        d = new float[z.length];
        float[] out = new float[z.length];
        int r = size / 2;
        for (int b = 0; b < n; b++)
            for (int o = 0; o < cout; o++)
                for (int i = 0; i < plane; i++) {
                    double sum = 0;
                    for (int j = Math.max(0, o - r); j <= Math.min(cout - 1, o + r); j++) {
                        float v = a[(b * cout + j) * plane + i];
                        sum += v * v;
                    }
                    int idx = (b * cout + o) * plane + i;
                    d[idx] = (float) (gamma + alpha * sum);
                    out[idx] = (float) (a[idx] / Math.pow(d[idx], beta));
                }
        return out;
    }

    /** Weight (and bias) gradient of sum(forward(x) * grad) for the last forward's input. */
    public float[][] backward(float[] grad) {
        int plane = ho * wo, r = size / 2;
        float[] inner = new float[z.length];     // g * a * d^(-beta-1)
        for (int i = 0; i < z.length; i++) inner[i] = (float) (grad[i] * a[i] * Math.pow(d[i], -beta - 1));
        float[] gz = new float[z.length];
        for (int b = 0; b < n; b++)
            for (int o = 0; o < cout; o++)
                for (int i = 0; i < plane; i++) {
                    int idx = (b * cout + o) * plane + i;
                    double band = 0;
                    for (int j = Math.max(0, o - r); j <= Math.min(cout - 1, o + r); j++) band += inner[(b * cout + j) * plane + i];
                    double ga = grad[idx] * Math.pow(d[idx], -beta) - 2 * alpha * beta * a[idx] * band;
                    boolean passes = z[idx] > 0 && (inputMax == null || z[idx] <= inputMax);
                    gz[idx] = passes ? (float) ga : 0f;
                }
        float[] gw = new float[weight.length];
        float[] gb = bias == null ? null : new float[cout];
        for (int b = 0; b < n; b++)
            for (int o = 0; o < cout; o++) {
                int zoff = (b * cout + o) * plane;
                if (gb != null) for (int i = 0; i < plane; i++) gb[o] += gz[zoff + i];
                for (int c = 0; c < cin; c++) {
                    int xoff = (b * cin + c) * h * w;
                    for (int ky = 0; ky < k; ky++)
                        for (int kx = 0; kx < k; kx++) {
                            double acc = 0;
                            for (int y = 0; y < ho; y++) {
                                int iy = y * stride + ky - pad;
                                if (iy < 0 || iy >= h) continue;
                                for (int xx = 0; xx < wo; xx++) {
                                    int ix = xx * stride + kx - pad;
                                    if (ix >= 0 && ix < w) acc += gz[zoff + y * wo + xx] * x[xoff + iy * w + ix];
                                }
                            }
                            gw[((o * cin + c) * k + ky) * k + kx] += (float) acc;
                        }
                }
            }
        return new float[][] {gw, gb};
    }

    /** A copy of the weights (for snapshots the client keeps until the server's checkpoint covers them). */
    public float[][] state() { return new float[][] {weight.clone(), bias == null ? null : bias.clone()}; }

    public void load(float[][] state) {
        System.arraycopy(state[0], 0, weight, 0, weight.length);
        if (bias != null) System.arraycopy(state[1], 0, bias, 0, bias.length);
    }
}
