package org.splitface.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Map;
import java.util.Random;
import java.util.TreeMap;
import org.junit.Rule;
import org.junit.Test;
import org.junit.rules.TemporaryFolder;

/**
 * The training progress survives the app (TrainingState, DeviceClient.persistIn): a restarted device gets back its
 * committed batch and the layer and SGD state of that batch, exactly, and a bad or foreign file is an error, never a
 * fresh start. (tests/test_android_core.py kills a Java device process with SIGKILL against the Python server.)
 */
public class TrainingStateTest {
    @Rule public TemporaryFolder tmp = new TemporaryFolder();   // deleted after each test

    static ReferenceLayerTrainer trainer() {
        DeviceLayer layer = DeviceLayerTest.layer(null);
        return new ReferenceLayerTrainer(layer, new Sgd(new float[][] {layer.weight, layer.bias}, 0.05, 0.9, 0.0, 0.1, 100));
    }

    static DeviceClient client(ReferenceLayerTrainer trainer) {
        return new DeviceClient("ws://127.0.0.1:1", JdkWebSocketTransport.factory(null), ClientSessionTest.session(), trainer,
                null, null, 1000, 1, Messages.DEFAULT_MAX_MESSAGE_BYTES);
    }

    /** Three SGD steps on made-up batches: the snapshots a device keeps after each commit. */
    static TreeMap<Long, Object> trained(ReferenceLayerTrainer t) {
        TreeMap<Long, Object> snapshots = new TreeMap<>();
        snapshots.put(0L, t.snapshot());
        Random r = new Random(3);
        for (long b = 1; b <= 3; b++) {
            float[] x = new float[2 * 3 * 25], g = new float[2 * 6 * 25];
            for (int i = 0; i < x.length; i++) x[i] = r.nextFloat();
            for (int i = 0; i < g.length; i++) g[i] = (float) r.nextGaussian();
            t.forward(x, 2, 5, 5);
            t.step(g);
            snapshots.put(b, t.snapshot());
        }
        snapshots.remove(0L);   // the server's checkpoint covered batch 1: snapshot 0 can never be needed
        return snapshots;
    }

    @Test
    public void aRestartedDeviceResumesItsCommittedBatchExactly() throws Exception {
        Path file = TrainingState.stateFile(tmp.newFolder().toPath(), "phone-01");
        ReferenceLayerTrainer before = trainer();
        new TrainingState(file, ClientSessionTest.session()).save(3, trained(before));

        ReferenceLayerTrainer after = trainer();   // the app restarted: a fresh layer at its initial weights
        DeviceClient restarted = client(after).persistIn(new TrainingState(file, ClientSessionTest.session()));
        assertEquals(3, restarted.committed());
        assertArrayEquals(before.layer.weight, after.layer.weight, 0f);
        assertArrayEquals(before.layer.bias, after.layer.bias, 0f);
        assertEquals(before.sgd.steps(), after.sgd.steps());
        float[][] bufBefore = (float[][]) before.sgd.state()[1], bufAfter = (float[][]) after.sgd.state()[1];
        for (int i = 0; i < bufBefore.length; i++) assertArrayEquals(bufBefore[i], bufAfter[i], 0f);
        TrainingState.Progress progress = new TrainingState(file, ClientSessionTest.session()).load();
        assertEquals(3, progress.committed);
        assertEquals(java.util.List.of(1L, 2L, 3L), new java.util.ArrayList<>(progress.snapshots.keySet()));
        try (var files = Files.list(file.getParent())) {
            assertEquals(java.util.List.of(file), files.toList());   // no temporary file left behind
        }
        assertEquals(0, client(trainer()).persistIn(new TrainingState(file.resolveSibling("new.training.msgpack"),
                ClientSessionTest.session())).committed());   // no file yet: batch 0, written at once
        assertTrue(Files.exists(file.resolveSibling("new.training.msgpack")));
    }

    @Test
    public void aCorruptOrForeignFileIsAnErrorNeverAFreshStart() throws Exception {
        Path file = TrainingState.stateFile(tmp.newFolder().toPath(), "phone-01");
        new TrainingState(file, ClientSessionTest.session()).save(3, trained(trainer()));
        byte[] good = Files.readAllBytes(file);
        byte[] edited = good.clone();
        edited[edited.length - 3] ^= 1;   // inside the last snapshot
        Files.write(file, edited);
        assertTrue(assertThrows(BudgetGuard.StateFileError.class, () -> client(trainer()).persistIn(
                new TrainingState(file, ClientSessionTest.session()))).getMessage().contains("checksum"));
        assertArrayEquals(edited, Files.readAllBytes(file));   // refused, not overwritten
        Files.write(file, good);
        ClientSession other = new ClientSession("phone-01", "t", new java.util.LinkedHashMap<>(Map.of("family", "iresnet")),
                "conv1", "server", 2, 10, Map.of("activations", "f32", "gradients", "f32"));
        assertTrue(assertThrows(BudgetGuard.StateFileError.class, () -> new TrainingState(file, other).load())
                .getMessage().contains("not of this device"));
        assertThrows(IllegalArgumentException.class, () -> TrainingState.stateFile(file.getParent(), "../elsewhere"));
    }
}
