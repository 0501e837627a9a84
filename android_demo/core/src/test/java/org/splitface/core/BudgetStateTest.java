package org.splitface.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.Map;
import org.junit.Rule;
import org.junit.Test;
import org.junit.rules.TemporaryFolder;

/** The budget survives the app (BudgetGuard.persistIn): resumed, refused past the budget, never reset by a bad or lost file. */
public class BudgetStateTest {
    @Rule public TemporaryFolder tmp = new TemporaryFolder();   // deleted after each test

    static final byte[] SCHEDULE = Wire.pack(Map.of("delta", 1e-5, "epsilon_after", List.of(1.0, 1.5, 1.9)));

    static BudgetGuard guard(Path file) {
        return BudgetGuard.fromSchedule(SCHEDULE, 1.6).persistIn(file, "phone-01");
    }

    @Test
    public void aRestartedGuardResumesItsReleasesAndRefusesPastTheBudget() throws Exception {
        Path dir = tmp.newFolder().toPath();
        Path file = BudgetGuard.stateFile(dir, "phone-01");
        BudgetGuard first = guard(file);
        assertTrue(Files.exists(file));   // written at once, before any release
        first.admit(new long[] {1, 2});
        BudgetGuard second = guard(file);   // the app restarted
        assertEquals(1.0, second.spent(), 0);
        second.admit(new long[] {1});
        assertEquals(1.5, second.spent(), 0);
        BudgetGuard third = guard(file);
        assertEquals(1.5, third.spent(), 0);
        assertThrows(BudgetGuard.BudgetExceeded.class, () -> third.admit(new long[] {1}));
        assertEquals(1.5, guard(file).spent(), 0);   // the refused release was not saved
        try (var files = Files.list(dir)) {
            assertEquals(List.of(file), files.toList());   // no temporary file left behind
        }
        assertThrows(IllegalArgumentException.class, () -> BudgetGuard.stateFile(dir, "../elsewhere"));
    }

    @Test
    public void aCorruptEditedOrForeignFileIsAnErrorNeverAReset() throws Exception {
        Path file = BudgetGuard.stateFile(tmp.newFolder().toPath(), "phone-01");
        guard(file).admit(new long[] {7});
        byte[] good = Files.readAllBytes(file);
        byte[] edited = good.clone();
        edited[edited.length - 1] ^= 1;   // the last byte of the state: a release count
        Files.write(file, edited);
        assertTrue(assertThrows(BudgetGuard.StateFileError.class, () -> guard(file)).getMessage().contains("checksum"));
        Files.write(file, java.util.Arrays.copyOf(good, good.length / 2));
        assertTrue(assertThrows(BudgetGuard.StateFileError.class, () -> guard(file)).getMessage().contains("corrupt"));
        assertArrayEquals(java.util.Arrays.copyOf(good, good.length / 2), Files.readAllBytes(file));   // refused, not overwritten
        Files.write(file, good);
        assertTrue(assertThrows(BudgetGuard.StateFileError.class,
                () -> BudgetGuard.fromSchedule(SCHEDULE, 1.6).persistIn(file, "phone-02")).getMessage().contains("phone-01"));
        assertEquals(1.0, guard(file).spent(), 0);
    }

    @Test
    public void aGuardBelowTheServersFigureHasLostItsState() throws Exception {
        Path file = BudgetGuard.stateFile(tmp.newFolder().toPath(), "phone-01");
        BudgetGuard fresh = guard(file);   // the old file was deleted: a new one starts at 0
        fresh.checkServerFigure("phone-01", null);
        fresh.admit(new long[] {1});
        fresh.checkServerFigure("phone-01", 1.0);   // resumed exactly where the server last heard
        String message = assertThrows(BudgetGuard.LostState.class, () -> fresh.checkServerFigure("phone-01", 1.5)).getMessage();
        assertTrue(message, message.contains(file.toString()) && message.contains("says epsilon 1.0 spent")
                && message.contains("the server recorded 1.5"));
    }
}
