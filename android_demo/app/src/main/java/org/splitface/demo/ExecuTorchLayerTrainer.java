package org.splitface.demo;

import java.util.Map;
import org.pytorch.executorch.EValue;
import org.pytorch.executorch.Module;
import org.pytorch.executorch.Tensor;
import org.pytorch.executorch.training.SGD;
import org.pytorch.executorch.training.TrainingModule;
import org.splitface.core.LayerTrainer;

/**
 * The device layer on ExecuTorch, from `splitface-export` artifacts: release.pte (XNNPACK; weights are
 * inputs) for the activations, train.pte (joint forward-backward, portable kernels) for the weight
 * gradient, and ExecuTorch's SGD for the step. The training program owns the weights; the release
 * program is given them on every call, so it always runs the current layer.
 */
final class ExecuTorchLayerTrainer implements LayerTrainer {
    private static final String METHOD = "forward";
    private final Module release;
    private final TrainingModule training;
    private final SGD sgd;
    private final String[] weightNames;   // from manifest.json, in the release program's input order
    private final int batchSize, channels, size;
    private Tensor lastImages;

    ExecuTorchLayerTrainer(String releasePte, String trainPte, String[] weightNames, int batchSize, int channels,
                           int size, double lr, double momentum, double weightDecay) {
        this.release = Module.load(releasePte);
        this.training = TrainingModule.load(trainPte);
        this.weightNames = weightNames;
        this.batchSize = batchSize; this.channels = channels; this.size = size;
        // Parameters exist once the program has run: one call on zeros, then the optimiser over them.
        float[] zeros = new float[batchSize * channels * size * size];
        long[] outShape = {batchSize, channels, size, size};
        training.executeForwardBackward(METHOD, EValue.from(Tensor.fromBlob(new float[batchSize * 3 * size * size],
                new long[] {batchSize, 3, size, size})), EValue.from(Tensor.fromBlob(zeros, outShape)),
                EValue.from(Tensor.fromBlob(zeros, outShape)));
        this.sgd = SGD.create(training.namedParameters(METHOD), lr, momentum, 0, weightDecay, false);
    }

    @Override public int[] outputShape(int n, int h, int w) { return new int[] {n, channels, size, size}; }

    @Override public float[] forward(float[] images, int n, int h, int w) {
        if (n != batchSize) throw new IllegalArgumentException("the programs were exported for batch " + batchSize);
        lastImages = Tensor.fromBlob(images, new long[] {n, 3, h, w});
        Map<String, Tensor> params = training.namedParameters(METHOD);
        EValue[] inputs = new EValue[2 + weightNames.length];
        inputs[0] = EValue.from(lastImages);
        inputs[1] = EValue.from(Tensor.fromBlob(new float[n * channels * size * size], new long[] {n, channels, size, size}));
        for (int i = 0; i < weightNames.length; i++) inputs[2 + i] = EValue.from(params.get("layer." + weightNames[i]));
        return release.forward(inputs)[0].toTensor().getDataAsFloatArray();   // noise is added by the DeviceClient
    }

    @Override public void step(float[] activationGrad) {
        long[] shape = {batchSize, channels, size, size};
        training.executeForwardBackward(METHOD, EValue.from(lastImages),
                EValue.from(Tensor.fromBlob(new float[activationGrad.length], shape)),
                EValue.from(Tensor.fromBlob(activationGrad, shape)));
        sgd.step(training.namedGradients(METHOD));
    }

    @Override public Object snapshot() { return null; }

    /** The Java API gives copies of the parameters, not writable views: a rollback cannot be applied in place. */
    @Override public void restore(Object snapshot) {
        throw new UnsupportedOperationException("the server restarted from an older checkpoint; rolling an ExecuTorch "
                + "training program back is not supported yet: reinstall the programs and start a new session");
    }
}
