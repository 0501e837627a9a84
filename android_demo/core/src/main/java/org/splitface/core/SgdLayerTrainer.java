package org.splitface.core;

/**
 * A trainer whose weights and SGD live in Java (a {@link DeviceLayer}'s arrays and {@link Sgd}): a step applies
 * {@link #weightGrads}, and a snapshot is a copy of both, so a rollback to a server checkpoint is exact.
 */
public abstract class SgdLayerTrainer implements LayerTrainer {
    public final DeviceLayer layer;   // its weight and bias: what the gradients update
    public final Sgd sgd;

    protected SgdLayerTrainer(DeviceLayer layer, Sgd sgd) { this.layer = layer; this.sgd = sgd; }

    @Override public abstract float[][] weightGrads(float[] activationGrad);

    @Override public int[] outputShape(int n, int h, int w) { return layer.outputShape(n, h, w); }

    @Override public void step(float[] activationGrad) { sgd.step(weightGrads(activationGrad)); }

    @Override public Object snapshot() { return new Object[] {layer.state(), sgd.state()}; }

    @Override public void restore(Object snapshot) {
        Object[] s = (Object[]) snapshot;
        layer.load((float[][]) s[0]);
        sgd.load((Object[]) s[1]);
    }
}
