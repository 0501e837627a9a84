package org.splitface.core;

/**
 * torch.optim.SGD (momentum, weight decay) with the source paper's exponential decay
 * lr_t = lr_0 * rate^(t / decaySteps), as splitface/common/optim.py, so a Java device trains like a Python one.
 */
public final class Sgd {
    private final double lr0, momentum, weightDecay, rate;
    private final long decaySteps;
    private long step;
    private final float[][] params, buffers;

    public Sgd(float[][] params, double lr, double momentum, double weightDecay, double rate, long decaySteps) {
        this.params = params; this.lr0 = lr; this.momentum = momentum; this.weightDecay = weightDecay;
        this.rate = rate; this.decaySteps = decaySteps;
        this.buffers = new float[params.length][];
    }

    public double lr() { return lr0 * Math.pow(rate, (double) step / decaySteps); }

    public void step(float[][] grads) {
        double lr = lr();
        for (int p = 0; p < params.length; p++) {
            if (params[p] == null) continue;
            float[] w = params[p], g = grads[p];
            if (buffers[p] == null && momentum != 0) buffers[p] = new float[w.length];
            boolean first = step == 0;
            for (int i = 0; i < w.length; i++) {
                float gi = (float) (g[i] + weightDecay * w[i]);
                if (momentum != 0) {
                    buffers[p][i] = first ? gi : (float) (momentum * buffers[p][i] + gi);
                    gi = buffers[p][i];
                }
                w[i] -= (float) (lr * gi);
            }
        }
        step++;
    }

    public long steps() { return step; }

    public Object[] state() {
        float[][] b = new float[buffers.length][];
        for (int i = 0; i < b.length; i++) b[i] = buffers[i] == null ? null : buffers[i].clone();
        return new Object[] {step, b};
    }

    public void load(Object[] state) {
        step = (Long) state[0];
        float[][] b = (float[][]) state[1];
        for (int i = 0; i < b.length; i++) buffers[i] = b[i] == null ? null : b[i].clone();
    }
}
